#!/usr/bin/env bash
# Multi-GPU session (nvidia-h200-x2): build, the sharding tests on both GPUs, the scaling
# benchmark. Run from the snapshot's root:  tools/gpu_scaling.sh
# Logs under $OUT (5 files): build.log, summary.txt, sharding.log, scaling.log, scaling.json.
# Expected ~3-5 min: build ~1 min, sharding tests ~1-2 min (XLA compiles), benchmark ~1-2 min.
# Limits: TEST_LIMIT (default 200 s), BENCH_LIMIT (240 s); BENCH_ARGS are passed through.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/jaxops-out}
mkdir -p "$out"
export OUT=$out PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 JAXOPS_CUDA_ARCHITECTURES=90
summary=$out/summary.txt
note() { echo "$*" | tee -a "$summary"; }

# (a) build and install (pip --no-build-isolation, sm_90); gpu_check.sh appends to summary.txt.
"$root/tools/gpu_check.sh" build || { note "build failed: see build.log"; exit 1; }

# (b) sharding tests: tests/sharding_cases.py runs in a child process on both GPUs (mesh 2x1).
# On-demand allocation: the pytest parent and its child share the GPUs without preallocating.
start=$(date +%s)
(cd /tmp && python3 -c "import jax, jaxops; print(jaxops.build_info(), jax.devices())" &&
 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 10 "${TEST_LIMIT:-200}" \
   python3 -m pytest -q -p no:cacheprovider -rf "$root/tests/test_sharding.py") >"$out/sharding.log" 2>&1
note "sharding rc=$? $(( $(date +%s) - start ))s"
tail -n 1 "$out/sharding.log" | sed 's/^/    /' | tee -a "$summary"

# (c) scaling benchmark: 1 GPU vs both, full sizes; JSON rewritten after every case.
start=$(date +%s)
(nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
 cd /tmp && timeout -k 10 "${BENCH_LIMIT:-240}" \
   python3 "$root/tools/bench_scaling.py" --json "$out/scaling.json" ${BENCH_ARGS:-}) >"$out/scaling.log" 2>&1
note "scaling rc=$? $(( $(date +%s) - start ))s"

echo "===== summary"
cat "$summary"
echo "===== sharding failures"
grep -E "^(FAILED|ERROR)" "$out/sharding.log" | head -30
echo "===== scaling"
grep -E "^\||FAILED|done:" "$out/scaling.log"
exit 0
