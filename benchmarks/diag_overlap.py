"""Diagnostic behind the QKVG default tactic: every plan-step candidate at a few M (TP8) for several QKVG tactics.

Usage (GPU machine): python benchmarks/diag_overlap.py 1,16
"""

import sys

import torch

from kda_backend.autotune import make_weight_copies, step_candidates, time_step
from kda_backend.geometry import preset

g = preset("kimi-k3", 8)
dev = torch.device("cuda")
weights = make_weight_copies(g, dev)
from kda_backend import dispatch
from kda_backend.kernels.skinny_gemm import Tactic

cute = dispatch.provider_by_name("cute")
variants = {
    "default": None,
    "k256s3": Tactic(16, 256, 16, 3),
    "k256s2": Tactic(16, 256, 16, 2),
    "k128s4": Tactic(16, 128, 16, 4),
    "k128s6": Tactic(16, 128, 16, 6),
    "k256s4-nopdl": Tactic(16, 256, 16, 4, pdl=False),
    "n32k128s4": Tactic(32, 128, 16, 4),
}
for name, tactic in variants.items():
    if tactic is not None:
        cute.add_tactics({("qkvg", g.qkvg_rows, g.hidden_size, 16): tactic})
    for m in [int(v) for v in sys.argv[1].split(",")]:
        steps = [s for s in step_candidates(m) if s.qkvg == "cute" or name == "default"]
        res = sorted((time_step(weights, s, m) * 1e6, f"{'ovl' if s.overlap else 'seq'} {s.qkvg}/{s.fab}") for s in steps)
        print(f"{name} M={m}: " + "  ".join(f"{lbl} {t:.2f}" for t, lbl in res), flush=True)
