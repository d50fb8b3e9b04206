"""QKVG alone with parts of the wgmma kernel switched off at trace time (``KDA_DIAG``, comma-separated:
``nomma`` no MMAs, ``nox`` no activation loads, ``halfx`` activations loaded for every second K-tile only, ``lag2``
two K-tiles of MMAs in flight), to see where the time goes. Outputs are wrong by design; only the times count.
Run one process per variant with its own KDA_BACKEND_CACHE_DIR.

Example (GPU): KDA_DIAG=nomma python benchmarks/tools/qkvg_load_diagnostic.py 8 64,96,128 w48k64s9p,w48k64s10mp
"""
import os
import sys

import torch
from stage_operands import StageOperands, kimi_k3, parse_tactic

from kda_backend.timing import copy_bandwidth, graph_time_per_layer

tp, ms, specs = int(sys.argv[1]), [int(v) for v in sys.argv[2].split(",")], sys.argv[3].split(",")
compile_only = len(sys.argv) > 4
g, weights, aux = kimi_k3(tp)
variant = os.environ.get("KDA_DIAG", "") or "base"
bw = None if compile_only else copy_bandwidth()
floor = None if compile_only else weights[0].w_qkvg.numel() * 2 / bw * 1e6
if floor:
    print(f"{variant} TP{tp} bw {bw/1e12:.3f} floor {floor:.2f}", flush=True)
for m in ms:
    ops = StageOperands(weights, m)
    if variant == "base" and not compile_only:
        def cub(i):
            j = i % ops.copies
            torch.mm(ops.xs[j], weights[j].w_qkvg.t(), out=ops.qkvg[j])
        t = graph_time_per_layer(cub) * 1e6
        print(f"{variant:12} M={m:3} cuBLAS {t:6.2f} us {floor/t*100:5.1f}%", flush=True)
    for spec in specs:
        tac = parse_tactic(spec, m)
        ops.qkvg_gemm(tac, 0)
        torch.cuda.synchronize()
        if compile_only:
            print("compiled", variant, m, tac.key(), flush=True)
            continue
        t = graph_time_per_layer(lambda i, tac=tac: ops.qkvg_gemm(tac, i)) * 1e6
        print(f"{variant:12} M={m:3} {tac.key():22} {t:6.2f} us {floor/t*100:5.1f}%", flush=True)
