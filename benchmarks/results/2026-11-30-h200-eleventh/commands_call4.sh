source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
( time timeout 330 python -m kda_backend autotune --tp 8 ) > $OUT/autotune.log 2>&1; tail -25 $OUT/autotune.log
mkdir -p $OUT/bench $OUT/bench_rerun
timeout 100 python -m kda_backend bench --tp 8 --out $OUT/bench > $OUT/bench/bench.txt 2>&1; cat $OUT/bench/bench.txt
timeout 100 python -m kda_backend bench --tp 8 --out $OUT/bench_rerun > $OUT/bench_rerun/bench.txt 2>&1; cat $OUT/bench_rerun/bench.txt
