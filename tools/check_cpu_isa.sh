#!/usr/bin/env bash
# Lists CPU-twin object files with AVX instructions outside the run_avx2 / run_avx512 clones of
# cc/common/cpu_vec.h, or with AVX-512 registers (zmm, k masks) inside an AVX2 clone. Code
# outside a clone must run on any x86-64 CPU, and an AVX2 clone on any AVX2 one; a helper that
# failed to inline into its clone would show up here. Needs objdump and unstripped objects:
#   tools/check_cpu_isa.sh build/dev-NAME   (after tools/dev_build.sh NAME)
set -euo pipefail
build=${1:?usage: tools/check_cpu_isa.sh BUILD_DIR}
bad=0
for obj in "$build"/CMakeFiles/_jaxops_cpu.dir/cc/*/*_cpu.cc.o; do
  leaks=$(objdump -d --no-show-raw-insn "$obj" |
    awk '/^[0-9a-f]+ </{fn=$0}
         /^ +[0-9a-f]+:\tv[a-z0-9]+ / && fn !~ /run_avx2|run_avx512/ {print "AVX outside a clone: " fn}
         /^ +[0-9a-f]+:\t/ && /%(zmm[0-9]|k[0-7])/ && fn ~ /run_avx2/ {print "AVX-512 in the AVX2 clone: " fn}' |
    sort -u | c++filt || true)
  if [ -n "$leaks" ]; then
    echo "$obj:"; echo "$leaks"; bad=1
  fi
done
[ $bad = 0 ] && echo "no AVX outside the clones, no AVX-512 in the AVX2 clones"
exit $bad
