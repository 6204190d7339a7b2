#!/usr/bin/env bash
# Lists CPU-twin object files with AVX (VEX/EVEX) instructions outside the run_avx2 clones of
# cc/common/cpu_vec.h. Code outside a clone must run on any x86-64 CPU; an 8-wide helper that
# failed to inline into its clone would show up here. Needs objdump and unstripped objects:
#   tools/check_cpu_isa.sh build/dev-NAME   (after tools/dev_build.sh NAME)
set -euo pipefail
build=${1:?usage: tools/check_cpu_isa.sh BUILD_DIR}
bad=0
for obj in "$build"/CMakeFiles/_jaxops_cpu.dir/cc/*/*_cpu.cc.o; do
  leaks=$(objdump -d --no-show-raw-insn "$obj" |
    awk '/^[0-9a-f]+ </{fn=$0} /^ +[0-9a-f]+:\tv[a-z0-9]+ /{print fn}' | sort -u | c++filt | grep -v run_avx2 || true)
  if [ -n "$leaks" ]; then
    echo "$obj:"; echo "$leaks"; bad=1
  fi
done
[ $bad = 0 ] && echo "no AVX outside the run_avx2 clones"
exit $bad
