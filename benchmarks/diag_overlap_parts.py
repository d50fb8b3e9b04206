"""Diagnostic: where the overlapped stage's time above QKVG alone goes (TP8, default tactics).

Per layer, QKVG runs on the main stream while the aux stream runs a growing part of the side chain, forked and
joined by the real scheduler: nothing (fork/join cost alone), the split-K F_A/beta kernel (which reduces its
partials itself), and the whole chain (+ F_B, launched programmatically behind it).

Usage (GPU machine): python benchmarks/diag_overlap_parts.py 1,16 [LL,Ln,nL,nn]
The optional second argument lists activation paths to compare: per variant one letter for QKVG, then one for
F_A/beta; ``L`` loads x through L1 (the default tactics), ``n`` through L2 only, ``T`` with the TMA unit.
"""

import dataclasses
import sys

import torch

from kda_backend.autotune import make_weight_copies
from kda_backend.geometry import preset
from kda_backend.kernels.skinny_gemm import default_tactic
from kda_backend.timing import graph_time_per_layer
from stage_operands import StageOperands, overlapped_time

X_PATHS = {"L": {"x_via_l1": True}, "n": {"x_via_l1": False}, "T": {"x_via_l1": False, "x_tma": True}}

g = preset("kimi-k3", 8)
weights = make_weight_copies(g, torch.device("cuda"))
aux = torch.cuda.Stream()
variants = sys.argv[2].split(",") if len(sys.argv) > 2 else ["LL"]
for m, variant in [(int(v), x_paths) for v in sys.argv[1].split(",") for x_paths in variants]:
    t_qkvg = dataclasses.replace(default_tactic(g.qkvg_rows, g.hidden_size, m), **X_PATHS[variant[0]])
    t_fab = dataclasses.replace(default_tactic(g.fab_rows, g.hidden_size, m), **X_PATHS[variant[1]])
    t_fb = default_tactic(g.local_width, g.head_dim, m)
    ops = StageOperands(weights, m)
    sides = {
        "nothing": lambda i: None,
        "fab": lambda i: ops.fab_gemm(t_fab, i),
        "fab + fb": lambda i: (ops.fab_gemm(t_fab, i), ops.fb_gemm(t_fb, i)),
    }

    def main(i):
        ops.qkvg_gemm(t_qkvg, i)

    for i in range(len(weights)):  # compile everything before capture
        main(i)
        for side in sides.values():
            side(i)
    alone = graph_time_per_layer(main) * 1e6
    print(f"M={m:2} {t_qkvg.key()} alone {alone:6.2f} us", flush=True)
    for name, side in sides.items():
        t = overlapped_time(main, side, aux) * 1e6
        print(f"M={m:2} {t_qkvg.key()} || {t_fab.key()} {name:8} {t:6.2f} us (+{t - alone:5.2f})", flush=True)
