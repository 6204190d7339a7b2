#!/usr/bin/env bash
# The closing GPU session: build, every test file in parallel, compute-sanitizer over a subset,
# and the benchmark of every family (one JSON each), all under $OUT (at most 8 files).
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/out} "$root/tools/gpu_check.sh" build ptest=${PTEST_LIMIT:-240} \
  sanitize="$root/tests/test_softmax.py $root/tests/test_layer_norm.py $root/tests/test_relu.py $root/tests/test_batch_norm.py $root/tests/test_reductions.py $root/tests/test_knn.py -k '${SANITIZE_K:-row_lengths_float32 or fully_masked or every_op or matches_reference or forward_and_grads}'"
grep -q "^build rc=0" "$OUT/summary.txt" && rm -f "$OUT/build.log"  # $OUT returns at most 8 files
cd /tmp
B="timeout ${BENCH_LIMIT:-75} python3 -m jaxops.bench --repeats 7"
$B --ops softmax,softmax_bwd,log_softmax,log_softmax_bwd --shapes 2097152x32,524288x128,65536x1024,16384x4096,8192x8192,2048x32768,512x131072,256x262144 --json $OUT/softmax.json >/dev/null 2>&1
$B --ops layer_norm,layer_norm_bwd,layer_norm_fwd_bwd,rms_norm,rms_norm_bwd,rms_norm_fwd_bwd --shapes 65536x1024,32768x2048,16384x4096,8192x8192 --json $OUT/layer_norm.json >/dev/null 2>&1
$B --ops relu,relu_bwd,bn_relu,bn_relu_bwd,bn_add_relu,bn_add_relu_bwd --json $OUT/normalization.json >/dev/null 2>&1
$B --ops sum,max,logsumexp,argmax,sum_cols,max_cols,logsumexp_cols,argmax_cols --json $OUT/reductions.json >/dev/null 2>&1
$B --dtypes float32 --ops knn,knn_vs_gemm,knn_3xtf32,knn_vs_seed_kmin,knn_vs_seed_sort --json $OUT/knn.json >/dev/null 2>&1
ls -la $OUT; cat $OUT/summary.txt
