source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache
start=$(date +%s)
timeout 70 python benchmarks/diag_qkvg_tactics.py 1,16 n48k256s4p n16k128s2x14p n16k128s4pL > $OUT/diag_final.log 2>&1; cat $OUT/diag_final.log
( time timeout 300 python -m kda_backend autotune --tp 8 ) > $OUT/autotune.log 2>&1; tail -32 $OUT/autotune.log
mkdir -p $OUT/bench; timeout 100 python -m kda_backend bench --tp 8 --out $OUT/bench > $OUT/bench/bench.txt 2>&1; grep -v "bench:" $OUT/bench/bench.txt
left=$((580 - ($(date +%s) - start)))
echo "left for kernel tests: $left s"
timeout $left python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu_kernels.py > $OUT/gpu_tests_kernels.log 2>&1; tail -5 $OUT/gpu_tests_kernels.log
