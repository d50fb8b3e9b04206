source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache
F=kda_backend/kernels/skinny_gemm.py
for v in none evict_first noneb evict_firstb; do
  p=${v%b}; [ "$p" = none ] && p=""
  sed -i "s/^W_L2_POLICY = .*/W_L2_POLICY = \"$p\"/" $F
  echo "== $v"; grep -E "^W_L2_POLICY" $F
  timeout 110 python benchmarks/diag_qkvg_tactics.py 1,2,8,16 n48k256s4p n16k128s2x14p n16k128s4pL > $OUT/pol_$v.log 2>&1; grep -v n16k256 $OUT/pol_$v.log
done
