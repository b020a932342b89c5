#!/usr/bin/env bash
# The whole GPU check in one run, within GPU_CHECK_SECONDS (default 470: under 8 minutes on an
# H200), every step bounded by `timeout` and logging under $OUT as it goes, then one table:
#   1. side by side (correctness, not timed): the fast tier on the GPU, each test under a
#      90 s timeout and named as it finishes (-v, -rf)                       ($OUT/pytest.txt);
#      jax's own dot_product_attention tests against qkv_jax               ($OUT/pytest_peers.txt);
#      the Pallas kernels' tests, slow ones included, as Triton kernels   ($OUT/pytest_pallas.txt);
#      every kind of call the dispatch rule sends to cuDNN, and the windows and segment ids it
#      keeps from cuDNN until they pass here, against the reference        ($OUT/cudnn_check.*);
#      the fused Pallas kernel against the reference, every option it claims
#      (benchmarks/gpu_probe.py --check pallas)                            ($OUT/kernel_check.*);
#   2. alone (timed): every attention option, forward and forward plus backward, for qkv_jax's
#      default and Pallas paths, cuDNN, jax.nn's XLA path, torch's SDPA and compiled
#      flex_attention (benchmarks/gpu_probe.py)                           ($OUT/probe.*);
#      the LM's train step against torch eager and torch.compile, and decoding tokens/s
#      (benchmarks/lm.py --gpu)                                            ($OUT/lm_gpu.*);
#      greedy generation's bfloat16 tokens/s at batch 1 and 16 on the Qwen2.5-0.5B-shaped
#      checkpoint, against transformers' generate and the weights' bytes over a measured
#      bandwidth (benchmarks/gpu_generate.py)                        ($OUT/generate_gpu.*);
#   3. one table of all of it (benchmarks/gpu_summary.py)                  ($OUT/summary.md).
# Exits non-zero if the tests or a check failed (every step runs regardless).
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh   # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run       # on CPU: the dispatch and precision tests, the
#                                                # checks and timings at tiny sizes
# The wheels the GPU machine lacks (../shared/tools/gpu-prep puts them in .gpu-wheels/) are
# installed first; wheels in .probe-wheels/ (optional peers for the timings) after the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=()
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=(--dry-run)
elif [[ $# -gt 0 ]]; then
  echo "usage: [OUT=dir] [GPU_CHECK_SECONDS=470] bash benchmarks/gpu_check.sh [--dry-run]" >&2
  exit 2
fi
OUT=${OUT:-$PWD/gpu_check_out}
# The logs go to a folder of their own, packed into $OUT/logs.tar.gz after each step (so a run
# cut short still brings them back), beside summary.md: the device tool returns 8 files at most.
final_out=$OUT
mkdir -p "$final_out"
logs_root=$(mktemp -d)
OUT=$logs_root/logs
mkdir -p "$OUT"
pack() { tar -czf "$final_out/logs.tar.gz" -C "$logs_root" logs; }
started=$SECONDS
total=${GPU_CHECK_SECONDS:-470}
status=0

if compgen -G ".gpu-wheels/*.whl" >/dev/null && [[ ${#dry_run[@]} -eq 0 ]]; then
  python3 -m pip install -q --no-index --no-deps --target .gpu-site .gpu-wheels/*.whl
  export PYTHONPATH=$PWD/.gpu-site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1
} | tee "$OUT/environment.txt"

# 1. Correctness, side by side: the GPU has room for all of it, and none of it is timed.
correct_s=$((total * 40 / 100))
echo "== 1. tests and checks, side by side (${correct_s} s)"
per_test=()  # pytest-timeout is on the GPU machine's image; not needed for a dry run
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 90)
if [[ ${#dry_run[@]} -eq 0 ]]; then
  tests=(-n 12 -m "not slow" --durations=20 tests)
else
  tests=(-p no:xdist tests/attention/test_dispatch.py tests/attention/test_precision.py)
fi
# The tests check values, not speed: XLA's GPU autotuning (most of a small program's compile
# time there) is off for them.
test_flags=${XLA_FLAGS:-}
((${#dry_run[@]})) || test_flags="$test_flags --xla_gpu_autotune_level=0"
XLA_FLAGS=$test_flags timeout "$correct_s" \
  python3 -m pytest -v -rf --tb=short "${per_test[@]}" -p no:cacheprovider "${tests[@]}" >"$OUT/pytest.txt" 2>&1 &
tests_pid=$!
peers_pid=
if [[ ${#dry_run[@]} -eq 0 ]]; then
  timeout "$correct_s" python3 -m pytest -q -rf "${per_test[@]}" -p no:cacheprovider -n 2 \
    tests/peers/test_jax_nn_attention.py >"$OUT/pytest_peers.txt" 2>&1 &
  peers_pid=$!
fi
pallas_pid=
if [[ ${#dry_run[@]} -eq 0 ]]; then  # the Pallas tests, slow tier too: on a GPU, Triton's kernels
  timeout "$correct_s" python3 -m pytest -v -rf --tb=short "${per_test[@]}" -p no:cacheprovider -p no:xdist \
    tests/attention/test_pallas_attention.py >"$OUT/pytest_pallas.txt" 2>&1 &
  pallas_pid=$!
fi
check_s=$((correct_s - 5))
timeout "$check_s" python3 benchmarks/gpu_probe.py --check pallas --out "$OUT/kernel_check.json" \
  "${dry_run[@]}" >"$OUT/kernel_check.txt" 2>&1 || { echo "kernel check: exit $?"; status=1; }
left=$((check_s - (SECONDS - started)))
if ((left > 20)); then
  timeout "$left" python3 benchmarks/attention.py --gpu-check --out "$OUT/cudnn_check.json" "${dry_run[@]}" \
    >"$OUT/cudnn_check.txt" 2>&1 || { echo "cuDNN check: exit $?"; status=1; }
else
  echo "cuDNN check: skipped, ${left} s left"
fi
wait $tests_pid || { echo "tests: exit $?"; status=1; }
if [[ -n $peers_pid ]]; then
  wait $peers_pid || { echo "peer tests: exit $?"; status=1; }
fi
if [[ -n $pallas_pid ]]; then
  wait $pallas_pid || { echo "Pallas tests: exit $?"; status=1; }
fi

pack

# 2. Timings, alone on the GPU.
if compgen -G ".probe-wheels/*.whl" >/dev/null && [[ ${#dry_run[@]} -eq 0 ]]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/probe-site .probe-wheels/*.whl \
    || echo "probe wheels: install failed"
  export PYTHONPATH=$PYTHONPATH:/tmp/probe-site
fi
left=$((total - 15 - (SECONDS - started)))
probe_s=$((left * 60 / 100))
echo "== 2. attention options timed (${probe_s} s), then the LM"
timeout "$probe_s" python3 benchmarks/gpu_probe.py --budget-s $((probe_s - 25)) --out "$OUT/probe.json" \
  "${dry_run[@]}" >"$OUT/probe.txt" 2>&1 || echo "probe: exit $? (its rows so far are in probe.txt)"
pack
left=$((total - 10 - (SECONDS - started)))
generate_s=$((left / 2 < 150 ? left / 2 : 150))
if ((generate_s > 30)); then
  timeout "$generate_s" python3 benchmarks/gpu_generate.py --out "$OUT" "${dry_run[@]}" \
    >"$OUT/generate_gpu.txt" 2>&1 || echo "generation benchmark: exit $?"
else
  echo "generation benchmark: skipped, ${generate_s} s"
fi
pack
left=$((total - 10 - (SECONDS - started)))
if ((left > 30)); then
  timeout "$left" python3 benchmarks/lm.py --gpu "${dry_run[@]}" >"$OUT/lm_gpu.txt" 2>&1 \
    || echo "LM benchmark: exit $?"
  cp benchmarks/results/lm_gpu.json "$OUT/lm_gpu.json" 2>/dev/null || true
else
  echo "LM benchmark: skipped, ${left} s left"
fi

# 3. One table.
write=(--write)
((${#dry_run[@]})) && write=()
python3 benchmarks/gpu_summary.py "$OUT" "${write[@]}" | tee "$OUT/summary.md"
cp "$OUT/summary.md" "$final_out/summary.md"
cp benchmarks/results/gpu_check_gpu.json "$final_out/" 2>/dev/null || true
pack && rm -rf "$logs_root"
echo "== done in $((SECONDS - started)) s; status $status; outputs in $final_out"
exit $status
