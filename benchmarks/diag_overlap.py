"""Diagnostic: every plan step candidate of the autotuner at a few M (TP8), default tactics."""

import sys

import torch

from kda_backend.autotune import make_weight_copies, step_candidates, time_step
from kda_backend.geometry import preset

g = preset("kimi-k3", 8)
dev = torch.device("cuda")
weights = make_weight_copies(g, dev)
for m in [int(v) for v in sys.argv[1].split(",")]:
    res = sorted((time_step(weights, s, m) * 1e6, f"{'ovl' if s.overlap else 'seq'} {s.qkvg}/{s.fab}") for s in step_candidates(m))
    print(f"M={m}: " + "  ".join(f"{lbl} {t:.2f}" for t, lbl in res), flush=True)
