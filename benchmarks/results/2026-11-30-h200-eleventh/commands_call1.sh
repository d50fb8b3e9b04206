source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache
F=kda_backend/kernels/skinny_gemm.py
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for v in base sidex1 part1 sideboth store1 baseb; do
  sed -i "s/^SIDE_X_ROWS = [0-9]*/SIDE_X_ROWS = 1048576/; s/^SIDE_PART_ROWS = [0-9]*/SIDE_PART_ROWS = 1048576/; s/^QKVG_STORE_ROWS = [0-9]*/QKVG_STORE_ROWS = 1048576/" $F
  case $v in
    sidex1) sed -i "s/^SIDE_X_ROWS = [0-9]*/SIDE_X_ROWS = 1/" $F;;
    part1) sed -i "s/^SIDE_PART_ROWS = [0-9]*/SIDE_PART_ROWS = 1/" $F;;
    sideboth) sed -i "s/^SIDE_X_ROWS = [0-9]*/SIDE_X_ROWS = 1/; s/^SIDE_PART_ROWS = [0-9]*/SIDE_PART_ROWS = 1/" $F;;
    store1) sed -i "s/^QKVG_STORE_ROWS = [0-9]*/QKVG_STORE_ROWS = 1/" $F;;
  esac
  echo "== $v"; grep -E "^(SIDE_X_ROWS|SIDE_PART_ROWS|QKVG_STORE_ROWS)" $F
  timeout 95 python benchmarks/diag_qkvg_tactics.py 2,8,16 n48k256s4p n16k128s2x14p n16k128s4pL > $OUT/side_$v.log 2>&1; grep -v n16k256 $OUT/side_$v.log
done
