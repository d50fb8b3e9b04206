source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache
F=kda_backend/kernels/skinny_gemm.py
for cop in none cs none2 cs2; do
  v=${cop%2}; [ $v = none ] && v=""
  sed -i "s/^STORE_COP = \"[a-z]*\"/STORE_COP = \"$v\"/" $F; grep "^STORE_COP" $F
  timeout 120 python benchmarks/diag_qkvg_tactics.py 2,8,16 n48k256s4p n16k128s2x14p n16k128s4pL > $OUT/store_$cop.log 2>&1; grep -v n16k256 $OUT/store_$cop.log
done
