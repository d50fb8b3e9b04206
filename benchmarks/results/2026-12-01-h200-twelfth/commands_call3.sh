# Call 3: the committed code
source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache
( time timeout 330 python -m kda_backend autotune --tp 8 ) > $OUT/autotune.log 2>&1; tail -34 $OUT/autotune.log
for r in bench bench_rerun bench_third; do
  mkdir -p $OUT/$r; timeout 75 python -m kda_backend bench --tp 8 --out $OUT/$r > $OUT/$r/bench.txt 2>&1; grep -v "bench:" $OUT/$r/bench.txt | head -60
done
# bench_third/bench.txt did not come back (too many files); it is render_table(bench_third/bench.json), which
# reproduces bench_rerun/bench.txt exactly from its JSON.
