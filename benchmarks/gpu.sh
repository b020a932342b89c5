#!/usr/bin/env bash
# One prepared run on an NVIDIA GPU (sized for an H200; under 5 minutes):
#   1. our attention paths against jax.nn's XLA and cuDNN kernels, bf16 and fp32,
#      forward and forward+backward, TFLOP/s against the chip's dense peak
#      (benchmarks/attention.py --gpu, which stops adding cases after --budget-s);
#   2. the char LM's training throughput and KV-cache decoding (benchmarks/lm.py --gpu);
#   3. docs/benchmarks.md rebuilt from benchmarks/results/*.json.
#
#   bash benchmarks/gpu.sh              # on the GPU machine, from anywhere in the repository
#   bash benchmarks/gpu.sh --dry-run    # the same steps at tiny sizes on any machine (CPU included);
#                                       # writes no results and leaves docs/benchmarks.md alone
#
# Needs jax with CUDA (pip install -U "jax[cuda12]") and this package (pip install -e .).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # report what each case needs, not a 75% pool

dry_run=()
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=(--dry-run)
elif [[ $# -gt 0 ]]; then
  echo "usage: bash benchmarks/gpu.sh [--dry-run]" >&2
  exit 2
fi

started=$SECONDS
python - <<'EOF'
import jax
print("devices:", jax.devices())
EOF
if [[ ${#dry_run[@]} -eq 0 ]] && ! python -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')"; then
  echo "error: JAX sees no GPU (jax.default_backend() != 'gpu'); use --dry-run to try the steps on CPU" >&2
  exit 1
fi

echo "== attention: ours vs XLA vs cuDNN (budget 200 s)"
timeout 270 python benchmarks/attention.py --gpu --budget-s 200 "${dry_run[@]}" \
  || echo "attention benchmark stopped early (exit $?)"

echo "== LM training throughput"
remaining=$((290 - (SECONDS - started)))
if ((remaining < 20)); then
  echo "skipped: only ${remaining} s left of the 5 minutes"
else
  timeout "$remaining" python benchmarks/lm.py --gpu --steps 50 "${dry_run[@]}" \
    || echo "LM benchmark stopped early (exit $?)"
fi

if [[ ${#dry_run[@]} -eq 0 ]]; then
  python -m benchmarks.report
fi
echo "== done in $((SECONDS - started)) s"
