# Call 1: l2_hints_experiment.patch applied on 1b66f0b (module constants toggled by sed)
source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache
F=kda_backend/kernels/l2_evict_first.py
for v in base:True:: woff:False:: xlast:True:evict_last: olast:True::evict_last ocs:True::cs baseb:True:: woffb:False::; do
  IFS=: read name w x o <<< "$v"
  sed -i -e "s/^WEIGHT_HINT = [A-Za-z]*/WEIGHT_HINT = $w/" -e "s/^X_HINT = \"[a-z_]*\"/X_HINT = \"$x\"/" -e "s/^OUT_HINT = \"[a-z_]*\"/OUT_HINT = \"$o\"/" $F
  echo "== $name"; grep -E "^(WEIGHT|X|OUT)_HINT" $F | tr '\n' ' '; echo
  timeout 75 python benchmarks/diag_qkvg_tactics.py 8,16,24,32 n48k256s4p,n64k256s4p n16k128s3x14p n16k128s3pL > $OUT/hint_$name.log 2>&1; grep -v "^copy" $OUT/hint_$name.log | cut -c1-200
done
