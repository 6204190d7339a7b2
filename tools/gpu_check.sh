#!/usr/bin/env bash
# One GPU-machine session: build, test, sanitize and benchmark, logs under $OUT.
#   tools/gpu_check.sh [build | stage[=DIR]] [test[=PYTEST_ARGS] | ptest[=LIMIT_S]] [sanitize[=PYTEST_ARGS]] [bench[=BENCH_ARGS]]
# Each step's log is $OUT/<step>.log; a summary of every step's status goes to $OUT/summary.txt.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/jaxops-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
summary=$out/summary.txt
note() { echo "$*" | tee -a "$summary"; }

step_build() {
  (cd "$root" && JAXOPS_CUDA=ON JAXOPS_CUDA_ARCHITECTURES=${JAXOPS_CUDA_ARCHITECTURES:-90} \
     CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps -v . ) >"$out/build.log" 2>&1
  local rc=$?
  # The slowest translation units (ninja's log, ms): what sets the build's pace.
  local log
  log=$(ls -t "$root"/build/*/.ninja_log 2>/dev/null | head -1)
  [ -n "$log" ] && { echo "== slowest targets"; awk '!/^#/ {printf "%7.1f s  %s\n", ($2 - $1) / 1000, $4}' "$log" |
    sort -rn | head -8; } >>"$out/build.log"
  return $rc
}
# Instead of build: installs build/dev-device/stage (tools/device_stage.sh, built on the
# workstation and carried) into python3's site-packages, in a few seconds; stage.log shows what it
# was built from, that it imports with CUDA and that a kernel runs. stage=DIR installs another
# stage (a copy kept for an A/B of two builds in one call; DIR relative to the repository root).
step_stage() {
  local site stage=$root/${1:-build/dev-device/stage}
  site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  (python3 -m pip uninstall -y -q jaxops 2>/dev/null; rm -rf "$site/jaxops" &&
   cp -r "$stage/jaxops" "$site/jaxops" && cat "$stage/STAMP" && cd /tmp &&
   python3 -c "import jaxops; i = jaxops.build_info(); print(i['platforms'], i['cuda_architectures'])
assert 'cuda' in i['platforms']
import jax, numpy as np  # one kernel: the driver loaded the stage's images
x = jax.random.normal(jax.random.key(0), (4, 1000))
assert jax.devices()[0].platform == 'gpu', jax.devices()
np.testing.assert_allclose(jaxops.softmax(x), jax.nn.softmax(x), rtol=1e-5, atol=1e-7)
print('softmax on', jax.devices()[0].device_kind)") >"$out/stage.log" 2>&1
}
step_test() {
  (cd /tmp && python -c "import jaxops, jax; print(jaxops.build_info(), jax.devices())" &&
   eval "python3 -m pytest -q -p no:cacheprovider ${1:-$root/tests}") >"$out/test.log" 2>&1
}
# The whole suite (or PTEST_FILES, a glob) at once, memory allocated on demand so the processes
# share the GPU; one combined log. By default every collected test of every file is dealt
# round-robin over PTEST_POOL processes (default: the machine's cores), so the long files spread
# over all of them: with a process a file (3 for the PTEST_SPLIT files) test_layer_norm,
# test_softmax, test_sanitizer and the CPU files never finished in 330-400 s (H100, sessions 68
# and 70), while test_softmax alone in 14 processes took 127 s and test_layer_norm in 15 took
# 194 s (session 70). PTEST_POOL=0 restores a process a file, PTEST_SPLIT files in PTEST_SHARDS.
# The PTEST_OWN files' tests (default test_sanitizer's, one per tool and op group) each get a
# process of their own, started at once.
step_ptest() {
  local limit=${1:-420} shards=${PTEST_SHARDS:-3} pool=${PTEST_POOL:-$(nproc)}
  local split=" ${PTEST_SPLIT:-test_batch_norm test_layer_norm test_softmax test_sanitizer test_reductions test_fuzz} "
  local own=" ${PTEST_OWN:-test_sanitizer} "
  export XLA_PYTHON_CLIENT_ALLOCATOR=platform
  mkdir -p /tmp/ptest && rm -f /tmp/ptest/*
  # Test ids of file $1 with its absolute path, into /tmp/ptest/<name>.ids.
  collect() {
    python3 -m pytest -q -p no:cacheprovider --collect-only "$1" 2>/dev/null | grep "::" |
      sed "s|^[^:]*::|$1::|" >/tmp/ptest/$(basename "$1" .py).ids
  }
  # pytest over the files or test ids after $1, in the background, its output into log $1.
  launch() {
    local log=$1
    shift
    timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rf --durations=5 "$@" >"$log" 2>&1 &
  }
  # The test ids in file $1 dealt round-robin over $2 processes, logs /tmp/ptest/$3.<k>.log.
  deal() {
    local k
    local -a ids
    for ((k = 0; k < $2; k++)); do
      mapfile -t ids < <(awk -v k=$k -v m=$2 'NR % m == k' "$1")
      [ ${#ids[@]} -gt 0 ] && launch /tmp/ptest/$3.$k.log "${ids[@]}"
    done
  }
  (cd /tmp && if [ "$pool" -gt 0 ]; then
     collecting=()
     for f in ${PTEST_FILES:-"$root"/tests/test_*.py}; do
       n=$(basename "$f" .py)
       # A module- or session-scoped fixture (test_cuda_graphs' three smoke runs, test_sharding's
       # child process) would run again in every process its tests were dealt to: such a file
       # runs whole in a process of its own.
       if grep -qE 'scope="(module|session)"' "$f"; then
         launch /tmp/ptest/$n.log "$f"
       elif [[ "$own" == *" $n "* ]]; then
         # Minutes-long tests (compute-sanitizer over a group of ops): each starts at once in a
         # process of its own; dealt into pools, session 71's ran last there and were cut by the cap.
         collect "$f"
         deal /tmp/ptest/$n.ids "$(wc -l </tmp/ptest/$n.ids)" $n
         rm /tmp/ptest/$n.ids
       else
         collect "$f" &
         collecting+=($!)
       fi
     done
     [ ${#collecting[@]} -gt 0 ] && wait "${collecting[@]}"
     cat /tmp/ptest/*.ids >/tmp/ptest/all.idlist 2>/dev/null
     deal /tmp/ptest/all.idlist "$pool" pool
   else
     for f in ${PTEST_FILES:-"$root"/tests/test_*.py}; do
       n=$(basename "$f" .py)
       if [[ "$split" == *" $n "* ]] && [ "$shards" -gt 1 ]; then
         collect "$f"
         deal /tmp/ptest/$n.ids "$shards" $n
       else
         launch /tmp/ptest/$n.log "$f"
       fi
     done
   fi; wait)
  local rc=0
  for log in /tmp/ptest/*.log; do
    echo "=== $(basename "$log")"
    grep -E "^FAILED|^ERROR|^E  |passed|failed|skipped in|[0-9.]+s (call|setup)" "$log" | head -60
    tail -n 1 "$log" | grep -qE " (passed|skipped)" && ! tail -n 1 "$log" | grep -qE "failed|error" || rc=1
  done >"$out/ptest.log"
  [ "$pool" -gt 0 ] && echo "$(cat /tmp/ptest/all.idlist 2>/dev/null | wc -l) tests dealt over $pool processes" >>"$out/ptest.log"
  for log in /tmp/ptest/*.log; do echo "=== $log"; cat "$log"; done >/tmp/ptest_full.log
  return $rc
}
step_sanitize() {
  local args=${1:-"$root/tests/test_softmax.py -k 'not 2_to_31'"}
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  (cd /tmp && for tool in memcheck racecheck; do
     echo "== $tool"
     # bash -c, not eval: the sanitizer launches a program (its children followed), and eval is a
     # shell builtin it cannot exec. Only jaxops's kernels are checked, as in test_sanitizer.py.
     compute-sanitizer --tool $tool --kernel-name kns=jaxops --error-exitcode 9 --print-limit 20 \
       bash -c "python3 -m pytest -q -x -p no:cacheprovider $args" || exit $?
   done) >"$out/sanitize.log" 2>&1
}
step_bench() {
  (cd /tmp && eval "python3 -m jaxops.bench ${1:-}" --json "$out/bench.json" --plot "$out/bench.png") >"$out/bench.log" 2>&1
}

for arg in "$@"; do
  step=${arg%%=*}
  params=""
  [[ "$arg" == *=* ]] && params=${arg#*=}
  start=$(date +%s)
  "step_$step" "$params"
  rc=$?
  note "$step rc=$rc $(( $(date +%s) - start ))s"
  tail -n 3 "$out/$step.log" | sed 's/^/    /' | tee -a "$summary"
  [ "$step" = build ] || [ "$step" = stage ] && [ $rc -ne 0 ] && { tail -n 60 "$out/$step.log"; exit 1; }
done
exit 0
