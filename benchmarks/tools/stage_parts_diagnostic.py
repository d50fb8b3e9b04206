"""Diagnostic build only: the fused stage whole, with its side chain idle (noside) and with QKVG idle (noqkvg).

Example (GPU): python benchmarks/tools/stage_parts_diagnostic.py 128,120,96 w56k64s9p,w112k64s10mc2p,w104k64s10mc2p
"""
import os, sys
sys.path.insert(0, "benchmarks/tools")
from stage_operands import StageOperands, kimi_k3, parse_tactic
from qkvg_tactics import fused_stage
from kda_backend.kernels.wgmma_stage import WgmmaStage, fused_stage_tactic
from kda_backend.kernels.wgmma_gemm import WgmmaTactic
from kda_backend.timing import copy_bandwidth

g, weights, aux = kimi_k3(8)
print(f"copy bandwidth {copy_bandwidth() / 1e12:.3f} TB/s", flush=True)
shapes = (g.qkvg_rows, g.fab_rows, g.local_width, g.hidden_size, g.head_dim)
for m in [int(v) for v in sys.argv[1].split(",")]:
    ops = StageOperands(weights, m)
    for spec in sys.argv[2].split(","):
        t = parse_tactic(spec, m)
        for mode in ("", "noside", "noqkvg", ""):
            os.environ["KDA_DIAG_STAGE"] = mode
            seconds, errors = fused_stage(ops, weights, WgmmaStage(t, *shapes))
            print(f"M={m:3} {t.key():20} {mode or 'whole':7} {seconds * 1e6:6.2f} us  {errors[:60]}", flush=True)
