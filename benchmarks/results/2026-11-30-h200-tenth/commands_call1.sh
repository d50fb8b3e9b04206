source benchmarks/gpu_env.sh && export KDA_BACKEND_CACHE_DIR=$PWD/.kda-cache
F=kda_backend/kernels/skinny_gemm.py
run() { timeout 150 python benchmarks/diag_x_replicas.py 2,8,16 n48k256s4p,n16k256s4p n16k128s2x14p n16k128s4p; }
setc() { sed -i "s/^$1 = .*/$1 = $2/" $F; }
for R in 1 4 16; do setc X_REPLICAS $R; run > $OUT/rep$R.log 2>&1; tail -7 $OUT/rep$R.log; done
setc X_REPLICAS 1
for P in 128B 256B; do setc W_L2_PREFETCH "\".L2::$P\""; run > $OUT/pf$P.log 2>&1; tail -7 $OUT/pf$P.log; done
setc W_L2_PREFETCH '""'
for L in 32 128; do DIAG_L2_FETCH=$L run > $OUT/fetch$L.log 2>&1; tail -7 $OUT/fetch$L.log; done
run > $OUT/rep1_again.log 2>&1; tail -7 $OUT/rep1_again.log
