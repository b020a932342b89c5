#!/usr/bin/env bash
# The whole GPU check in one run (under 10 minutes on an H200), results under $OUT:
#   1. the wheels the GPU machine lacks, installed as ../shared/tools/gpu-prep prepared them;
#   2. the test suite on the GPU: pytest -n 8 -m "not slow" tests       ($OUT/pytest.txt),
#      then jax's own dot_product_attention tests against qkv_jax, cuDNN cases included
#      (tests/peers/test_jax_nn_attention.py)                              ($OUT/pytest_peers.txt);
#   3. every kind of call the dispatch rule sends to cuDNN, and the local windows and segment
#      ids it keeps from cuDNN until they pass here (asked for as implementation="cudnn"),
#      outputs and gradients against the reference path on the GPU
#      (benchmarks/attention.py --gpu-check)                                ($OUT/cudnn_check.*);
#   4. bash benchmarks/gpu.sh: attention and LM benchmarks, docs/benchmarks.md
#      ($OUT/results/*.json, $OUT/benchmarks.md, $OUT/gpu_sh.txt).
# Exits non-zero if the tests or the cuDNN check failed (every step runs regardless).
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh   # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run       # on CPU: no install, the dispatch and precision
#                                                # tests only, the check and gpu.sh at tiny sizes
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=()
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=(--dry-run)
elif [[ $# -gt 0 ]]; then
  echo "usage: [OUT=dir] bash benchmarks/gpu_check.sh [--dry-run]" >&2
  exit 2
fi
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT/results"
started=$SECONDS
status=0

if compgen -G ".gpu-wheels/*.whl" >/dev/null && [[ ${#dry_run[@]} -eq 0 ]]; then
  python3 -m pip install -q --no-index --no-deps --target .gpu-site .gpu-wheels/*.whl
  export PYTHONPATH=$PWD/.gpu-site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

{
  nvidia-smi 2>&1 || echo "no nvidia-smi"
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1
} | tee "$OUT/environment.txt"

total=${GPU_CHECK_SECONDS:-470}  # the whole check within 8 minutes on an H200
probe_wheels=()
compgen -G ".probe-wheels/*.whl" >/dev/null && probe_wheels=(.probe-wheels/*.whl)

# The fast tier, jax's own attention tests and the cuDNN check share the GPU at once (16 cores,
# 139 GiB): each names its failures as they happen (-v, -rf, a per-test timeout), so a step cut
# off at its limit still says what failed.
echo "== fast tier, jax.nn's attention tests and the cuDNN check, side by side (timeout 170 s)"
if [[ ${#dry_run[@]} -eq 0 ]]; then
  tests=(-n 11 -m "not slow" tests)
else
  tests=(-p no:xdist tests/attention/test_dispatch.py tests/attention/test_precision.py)
fi
per_test=()  # pytest-timeout is on the GPU machine's image; not needed for a dry run
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 90)
timeout 170 python3 -m pytest -v -rf "${per_test[@]}" -p no:cacheprovider "${tests[@]}" >"$OUT/pytest.txt" 2>&1 &
tests_pid=$!
if [[ ${#dry_run[@]} -eq 0 ]]; then
  timeout 170 python3 -m pytest -q -rf "${per_test[@]}" -p no:cacheprovider -n 3 tests/peers/test_jax_nn_attention.py \
    >"$OUT/pytest_peers.txt" 2>&1 &
  peers_pid=$!
fi
timeout 150 python3 benchmarks/attention.py --gpu-check --out "$OUT/cudnn_check.json" "${dry_run[@]}" \
  >"$OUT/cudnn_check.txt" 2>&1
rc=$?
tail -n 3 "$OUT/cudnn_check.txt"
if ((rc != 0)); then echo "cuDNN check: exit $rc"; status=1; fi
wait $tests_pid
rc=$?
grep -E "^(FAILED|ERROR)|Timeout|passed|failed" "$OUT/pytest.txt" | tail -n 25
if ((rc != 0)); then echo "tests: exit $rc"; status=1; fi
if [[ ${#dry_run[@]} -eq 0 ]]; then
  wait $peers_pid
  rc=$?
  tail -n 5 "$OUT/pytest_peers.txt"
  if ((rc != 0)); then echo "peer tests: exit $rc"; status=1; fi
fi

echo "== the fused paths on offer, side by side (timeout 140 s)"
if ((${#probe_wheels[@]})); then
  python3 -m pip install -q --no-index --no-deps --target /tmp/probe-site "${probe_wheels[@]}" \
    || echo "probe wheels: install failed"
fi
PYTHONPATH=$PYTHONPATH:/tmp/probe-site timeout 140 python3 benchmarks/gpu_probe.py --budget-s 110 \
  --out "$OUT/probe.json" "${dry_run[@]}" >"$OUT/probe.txt" 2>&1 || echo "probe: exit $?"
sed -n '/^name /,$p' "$OUT/probe.txt"

left=$((total - (SECONDS - started)))
gpu_sh_seconds=$((left > 290 ? 290 : left))
echo "== benchmarks/gpu.sh (${gpu_sh_seconds} s)"
if ((gpu_sh_seconds < 60)); then
  echo "skipped: only ${left} s left"
else
  GPU_SH_SECONDS=$gpu_sh_seconds bash benchmarks/gpu.sh "${dry_run[@]}" 2>&1 | tee "$OUT/gpu_sh.txt" \
    | grep -E "^(==|\||wrote|error|skipped)" || true
fi
if [[ ${#dry_run[@]} -eq 0 ]]; then
  cp benchmarks/results/*_gpu.json "$OUT/results/" 2>/dev/null || echo "no GPU results written"
  cp docs/benchmarks.md "$OUT/benchmarks.md"
fi
echo "== done in $((SECONDS - started)) s; status $status; outputs in $OUT"
exit $status
