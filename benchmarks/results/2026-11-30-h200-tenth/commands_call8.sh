source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache
F=kda_backend/kernels/skinny_gemm.py
for cap in 1048576 8 1 1048576b; do
  sed -i "s/^X_ROWS_LOADED = [0-9]*/X_ROWS_LOADED = ${cap%b}/" $F; grep "^X_ROWS_LOADED" $F
  timeout 120 python benchmarks/diag_qkvg_tactics.py 2,8,16 n48k256s4p n16k128s2x14p n16k128s4pL > $OUT/xrows_$cap.log 2>&1; cat $OUT/xrows_$cap.log
done
