#!/usr/bin/env bash
# Builds jaxops into build/dev-NAME/stage without touching site-packages, so several
# developers can build from one tree at once. Use the result with PYTHONPATH:
#   tools/dev_build.sh NAME [cuda]        # cuda: also build the CUDA handlers (sm_90 only)
# PYTHON picks the interpreter the modules are built for (default: python3); JAXOPS_CUDA_COMPRESS=OFF
# leaves the CUDA images uncompressed (CMakeLists.txt).
#   PYTHONPATH=build/dev-NAME/stage pytest -q tests/test_softmax.py
# (plain `pytest`, or python from outside the tree: `python -m` puts the source jaxops/ first.)
set -euo pipefail
name=${1:?usage: tools/dev_build.sh NAME [cuda]}
cuda=OFF
[ "${2:-}" = cuda ] && cuda=ON
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build/dev-$name
stage=$build/stage
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAXOPS_CUDA=$cuda \
  -DJAXOPS_CUDA_ARCHITECTURES=${JAXOPS_CUDA_ARCHITECTURES:-90} -DJAXOPS_CUDA_COMPRESS=${JAXOPS_CUDA_COMPRESS:-ON} \
  -DPython_EXECUTABLE="${PYTHON:-$(command -v python3)}" >/dev/null
cmake --build "$build" -j "${JOBS:-2}"
rm -rf "$stage/jaxops" && mkdir -p "$stage"
cp -r "$root/jaxops" "$stage/jaxops" && rm -f "$stage/jaxops/"*.so
cp "$build"/_jaxops_*.so "$stage/jaxops/"
[ $cuda = ON ] || rm -f "$stage/jaxops/_jaxops_cuda"*.so
echo "staged: PYTHONPATH=$stage"
