source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache
for p in 0 -5 0 -5; do
  DIAG_AUX_PRIORITY=$p timeout 120 python benchmarks/diag_qkvg_tactics.py 2,8,16 n48k256s4p n16k128s2x14p n16k128s4pL 2>&1 | grep -v n16k256 | tee -a $OUT/aux_priority.log
done
