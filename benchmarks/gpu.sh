#!/usr/bin/env bash
# One prepared run on an NVIDIA GPU (sized for an H200; under 5 minutes):
#   1. attention: our default path against jax.nn's cuDNN kernel and torch's SDPA (same process,
#      same shapes), bf16 causal training at T 4096 and 16384 first, then forward, full, padded
#      (lengths), bias, boolean mask, causal T != S and float32; per-call times with dispatch
#      amortised, TFLOP/s and share of the dense peak (benchmarks/attention.py --gpu, which
#      stops adding cases after --budget-s);
#   2. the char LM's training throughput and KV-cache decoding (benchmarks/lm.py --gpu);
#   3. docs/benchmarks.md rebuilt from benchmarks/results/*.json (its GPU section included).
#
#   bash benchmarks/gpu.sh              # on the GPU machine, from anywhere in the repository
#   bash benchmarks/gpu.sh --dry-run    # the same steps at tiny sizes on any machine (CPU included);
#                                       # writes no results and leaves docs/benchmarks.md alone
#   GPU_SH_SECONDS=240 bash benchmarks/gpu.sh   # a shorter run (benchmarks/gpu_check.sh sets it)
#
# Needs jax with CUDA and this package importable (pip install -e ., or PYTHONPATH as
# benchmarks/gpu_check.sh sets it); torch with CUDA for the peer column.
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
total=${GPU_SH_SECONDS:-290}
attention_budget=$((total * 190 / 290))
python - <<'PY'
import jax
print("devices:", jax.devices())
PY
if [[ ${#dry_run[@]} -eq 0 ]] && ! python -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')"; then
  echo "error: JAX sees no GPU (jax.default_backend() != 'gpu'); use --dry-run to try the steps on CPU" >&2
  exit 1
fi

echo "== attention: default vs jax.nn cuDNN vs torch SDPA (budget ${attention_budget} s)"
timeout $((attention_budget + 50)) python benchmarks/attention.py --gpu --budget-s "$attention_budget" \
  "${dry_run[@]}" || echo "attention benchmark stopped early (exit $?)"

echo "== LM training throughput"
remaining=$((total - (SECONDS - started)))
if ((remaining < 20)); then
  echo "skipped: only ${remaining} s left of ${total}"
else
  timeout "$remaining" python benchmarks/lm.py --gpu --steps 50 "${dry_run[@]}" \
    || echo "LM benchmark stopped early (exit $?)"
fi

if [[ ${#dry_run[@]} -eq 0 ]]; then
  python -m benchmarks.report
fi
echo "== done in $((SECONDS - started)) s"
