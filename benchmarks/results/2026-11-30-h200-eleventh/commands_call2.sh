source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache
F=kda_backend/kernels/skinny_gemm.py
for v in base scratch store1 baseb scratchb store1b; do
  sed -i "s/^QKVG_STORE_SPREAD = [0-9]*/QKVG_STORE_SPREAD = 1/; s/^QKVG_STORE_ROWS = [0-9]*/QKVG_STORE_ROWS = 1048576/" $F
  case $v in
    scratch*) sed -i "s/^QKVG_STORE_SPREAD = [0-9]*/QKVG_STORE_SPREAD = 0/" $F;;
    store1*) sed -i "s/^QKVG_STORE_ROWS = [0-9]*/QKVG_STORE_ROWS = 1/" $F;;
  esac
  echo "== $v"; grep -E "^(QKVG_STORE_SPREAD|QKVG_STORE_ROWS)" $F | cut -c1-30
  timeout 95 python benchmarks/diag_qkvg_tactics.py 2,8,16 n48k256s4p n16k128s2x14p n16k128s4pL > $OUT/st_$v.log 2>&1; grep -v n16k256 $OUT/st_$v.log
done
