# Call 5: the committed code; "normal" gives the activations evict_normal. Ran as .dev5.py at the repo root.
source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache KDA_BACKEND_PLAN=overlap KDA_BACKEND_PROVIDER=cute
F=kda_backend/kernels/skinny_gemm.py; cp $F /tmp/orig.py
for v in last normal lastb normalb; do
  cp /tmp/orig.py $F
  case $v in normal*) sed -i 's/l2_policy(EVICT_FIRST), l2_policy(EVICT_LAST)/l2_policy(EVICT_FIRST), l2_policy("evict_normal")/' $F;; esac
  echo "== $v $(grep -c 'l2_policy("evict_normal")' $F)"
  timeout 140 python benchmarks/results/2026-12-01-h200-twelfth/decode_step_experiment.py $v 2>&1 | grep -v Warn | tail -4 | tee $OUT/step_$v.log
done
cp /tmp/orig.py $F
