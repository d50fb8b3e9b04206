"""Fused stage time at each M (its own tactic), three timings each: python benchmarks/tools/fused_stage_ab.py 104,160,224"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path.cwd() / "benchmarks/tools"))
import kda_backend
from qkvg_tactics import fused_stage
from stage_operands import StageOperands, kimi_k3
from kda_backend.kernels.wgmma_stage import WgmmaStage, fused_stage_tactic
print("kda_backend from", kda_backend.__file__, flush=True)
g, weights, aux = kimi_k3(8)
shapes = (g.qkvg_rows, g.fab_rows, g.local_width, g.hidden_size, g.head_dim)
for m in map(int, sys.argv[1].split(",")):
    ops = StageOperands(weights, m)
    stage = WgmmaStage(fused_stage_tactic(g.qkvg_rows, g.hidden_size, m), *shapes)
    runs = [fused_stage(ops, weights, stage) for _ in range(3)]
    print(f"M={m} qkvg {stage.plan.qkvg.key()} fab {stage.plan.fab.key()} partial {stage.plan.fab.partial_bytes()} B:",
          " ".join(f"{s * 1e6:.2f}" for s, _ in runs), "us;", runs[0][1], flush=True)
