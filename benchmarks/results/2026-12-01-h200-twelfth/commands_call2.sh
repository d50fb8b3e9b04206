# Call 2: the committed code (weights evict-first, activations evict-last); "woff" gives the weights evict_normal
source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache
F=kda_backend/kernels/skinny_gemm.py
cp $F /tmp/orig.py
start=$(date +%s)
for v in xlast woff xlastb woffb; do
  cp /tmp/orig.py $F
  case $v in woff*) sed -i 's/l2_policy(EVICT_FIRST), l2_policy(EVICT_LAST)/l2_policy("evict_normal"), l2_policy(EVICT_LAST)/' $F;; esac
  echo "== $v: $(grep -c 'l2_policy("evict_normal")' $F) evict_normal"
  timeout 100 python benchmarks/diag_qkvg_tactics.py 1,4,8,16,24,32,64 n48k256s4p,n64k256s4p n16k128s3x14p n16k128s3pL > $OUT/pol2_$v.log 2>&1; grep -v "^copy" $OUT/pol2_$v.log | cut -c1-130
done
cp /tmp/orig.py $F; git diff --stat
left=$((570 - ($(date +%s) - start)))
echo "left for kernel tests: $left s"
timeout $left python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu_kernels.py > $OUT/gpu_tests_kernels.log 2>&1; tail -5 $OUT/gpu_tests_kernels.log
