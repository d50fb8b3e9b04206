"""Diagnostic build only: the fused stage whole and in the modes of KDA_DIAG_STAGE (DIAG_MODES, comma-separated,
empty for the build as it is): noside / noqkvg leave the side chain's or QKVG's CTAs idle; rows40 / rows48 split
F_A/beta in row blocks of at least that many rows (fewer side-chain CTAs); late4 starts the side chain about 4 us
late; fabk8 runs F_A/beta over an eighth of K (wrong outputs: a bound).

Example (GPU): DIAG_MODES=",noside,rows48,late4,fabk8," python benchmarks/tools/stage_parts_diagnostic.py 128,96 \
               w56k64s9p,w112k64s10mc2p
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
MODES = os.environ.get("DIAG_MODES", ",noside,noqkvg,").split(",")
shapes = (g.qkvg_rows, g.fab_rows, g.local_width, g.hidden_size, g.head_dim)
for m in [int(v) for v in sys.argv[1].split(",")]:
    ops = StageOperands(weights, m)
    for spec in sys.argv[2].split(","):
        t = parse_tactic(spec, m)
        for mode in MODES:
            os.environ["KDA_DIAG_STAGE"] = mode
            seconds, errors = fused_stage(ops, weights, WgmmaStage(t, *shapes))
            print(f"M={m:3} {t.key():20} {mode or 'whole':7} {seconds * 1e6:6.2f} us  {errors[:60]}", flush=True)
