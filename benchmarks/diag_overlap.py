"""Diagnostic: every plan step candidate at a few M, with and without PDL on the CuTe kernels."""

import sys

import torch

from kda_backend import dispatch
from kda_backend.autotune import make_weight_copies, step_candidates, time_step
from kda_backend.geometry import preset
from kda_backend.kernels.skinny_gemm import default_tactic

g = preset("kimi-k3", 8)
dev = torch.device("cuda")
weights = make_weight_copies(g, dev)
cute = dispatch.provider_by_name("cute")
for pdl in (True, False):
    table = {}
    for role, n, k in (("qkvg", g.qkvg_rows, g.hidden_size), ("fab", g.fab_rows, g.hidden_size), ("fb", g.local_width, g.head_dim)):
        for bt in (16,):
            t = default_tactic(n, k, 1)
            table[(role, n, k, bt)] = t.__class__(**{**t.__dict__, "pdl": pdl, "stages": 12 if role == "fab" else t.stages})
    cute.add_tactics(table)
    for m in [int(v) for v in sys.argv[1].split(",")]:
        res = sorted((time_step(weights, s, m) * 1e6, f"{'ovl' if s.overlap else 'seq'} {s.qkvg}/{s.fab}") for s in step_candidates(m))
        print(f"pdl={pdl} M={m}: " + "  ".join(f"{lbl} {t:.2f}" for t, lbl in res), flush=True)
