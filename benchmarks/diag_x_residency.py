"""Diagnostic: how much of the stage's growth with M comes from activations arriving cold from HBM?

The benchmarks rotate x with the weights, so each layer's x was evicted from L2 long before its layer runs. In
serving, x is the previous kernel's output and sits in L2. This times QKVG alone and the overlapped stage (default
tactics) with rotated x and with one x shared by every layer (L2-resident after the first layer).

Usage (GPU machine): python benchmarks/diag_x_residency.py 1,8,16
"""

import sys

import torch
from stage_operands import StageOperands, overlapped_time

from kda_backend.autotune import make_weight_copies
from kda_backend.geometry import preset
from kda_backend.kernels.skinny_gemm import default_tactic
from kda_backend.timing import graph_time_per_layer

g = preset("kimi-k3", 8)
weights = make_weight_copies(g, torch.device("cuda"))
aux = torch.cuda.Stream()
for m in [int(v) for v in sys.argv[1].split(",")]:
    t_qkvg = default_tactic(g.qkvg_rows, g.hidden_size, m)
    t_fab = default_tactic(g.fab_rows, g.hidden_size, m)
    t_fb = default_tactic(g.local_width, g.head_dim, m)
    for residency in ("rotated", "shared", "rotated", "shared"):
        ops = StageOperands(weights, m)
        if residency == "shared":
            ops.xs = [ops.xs[0]] * len(weights)

        def main(i, ops=ops, t_qkvg=t_qkvg):
            ops.qkvg_gemm(t_qkvg, i)

        def side(i, ops=ops, t_fab=t_fab, t_fb=t_fb):
            ops.fab_gemm(t_fab, i)
            ops.fb_gemm(t_fb, i)

        for i in range(len(weights)):  # compile everything before capture
            main(i)
            side(i)
        alone = graph_time_per_layer(main) * 1e6
        stage = overlapped_time(main, side, aux) * 1e6
        print(f"M={m:2} x {residency:7} QKVG alone {alone:6.2f} us, stage {stage:6.2f} us (+{stage - alone:4.2f})",
              flush=True)
