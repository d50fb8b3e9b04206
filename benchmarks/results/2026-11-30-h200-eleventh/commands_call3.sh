source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache
F=kda_backend/kernels/skinny_gemm.py
for v in 0 1 0b 1b; do
  sed -i "s/^QKVG_O_TMA = [0-9]*/QKVG_O_TMA = ${v%b}/" $F
  echo "== $v"; grep -E "^QKVG_O_TMA" $F | cut -c1-16
  timeout 95 python benchmarks/diag_qkvg_tactics.py 1,2,8,16 n48k256s4p n16k128s2x14p n16k128s4pL > $OUT/otma_$v.log 2>&1; grep -v n16k256 $OUT/otma_$v.log
done
