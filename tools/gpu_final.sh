#!/usr/bin/env bash
# The closing GPU session: build, every test file in parallel (tests/test_sanitizer.py runs
# compute-sanitizer memcheck and racecheck over every op meanwhile), then the benchmark of every
# family, one JSON each, all under $OUT (which returns at most 8 files).
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/out} "$root/tools/gpu_check.sh" build ptest=${PTEST_LIMIT:-420}
grep -q "^build rc=0" "$OUT/summary.txt" && rm -f "$OUT/build.log"
cd /tmp
B="timeout ${BENCH_LIMIT:-75} python3 -m jaxops.bench --repeats 7"
$B --ops softmax,softmax_bwd,log_softmax,log_softmax_bwd --shapes 2097152x32,524288x128,65536x1024,16384x4096,8192x8192,2048x32768,512x131072,256x262144 --json $OUT/softmax.json >/dev/null 2>&1
$B --ops layer_norm,layer_norm_bwd,rms_norm,rms_norm_bwd --shapes 65536x1024,16384x4096,8192x8192 --json $OUT/layer_norm.json >/dev/null 2>&1
$B --ops relu,relu_bwd,bn_relu,bn_relu_bwd,bn_add_relu,bn_add_relu_bwd --json $OUT/normalization.json >/dev/null 2>&1
$B --ops sum,max,logsumexp,argmax,sum_cols,argmax_cols --json $OUT/reductions.json >/dev/null 2>&1
$B --dtypes float32 --ops knn,knn_vs_gemm,knn_vs_seed_kmin,knn_vs_seed_sort --json $OUT/knn.json >/dev/null 2>&1
cat $OUT/summary.txt
