# Call 6: the committed code (67dc348), a fresh machine
source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache
( time timeout 250 python -m kda_backend autotune --tp 8 --max-m 16 ) > $OUT/autotune_m16.log 2>&1; tail -5 $OUT/autotune_m16.log
MS=$(seq -s, 1 16)
for r in bench_m16 bench_m16_rerun; do
  mkdir -p $OUT/$r; timeout 60 python -m kda_backend bench --tp 8 --ms $MS --out $OUT/$r > $OUT/$r/bench.txt 2>&1; grep -v "bench:" $OUT/$r/bench.txt | head -22
done
