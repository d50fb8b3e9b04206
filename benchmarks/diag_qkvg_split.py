"""Diagnostic: can split-K QKVG tactics (wider CTAs, each reading a part of x, reduced in-kernel) beat the default
16-row tactic, alone and inside the overlapped stage? (TP8; F_A/beta and F_B on their default tactics.)

Usage (GPU machine): python benchmarks/diag_qkvg_split.py 1,8,16
"""

import sys

import torch

from kda_backend.autotune import make_weight_copies
from kda_backend.geometry import preset
from kda_backend.kernels.skinny_gemm import Tactic, default_tactic
from kda_backend.timing import graph_time_per_layer
from stage_operands import StageOperands, overlapped_time

SPLIT_QKVG = [Tactic(32, 128, 16, 4, split_k=2), Tactic(32, 128, 16, 5, split_k=2), Tactic(64, 64, 16, 6, split_k=4),
              Tactic(32, 256, 16, 2, split_k=2), Tactic(64, 128, 16, 3, split_k=4), Tactic(32, 128, 16, 4, split_k=4)]

g = preset("kimi-k3", 8)
weights = make_weight_copies(g, torch.device("cuda"))
aux = torch.cuda.Stream()
for m in [int(v) for v in sys.argv[1].split(",")]:
    t_fab = default_tactic(g.fab_rows, g.hidden_size, m)
    t_fb = default_tactic(g.local_width, g.head_dim, m)
    ops = StageOperands(weights, m)

    def side(i):
        ops.fab_gemm(t_fab, i)
        ops.fb_gemm(t_fb, i)

    for t_qkvg in [default_tactic(g.qkvg_rows, g.hidden_size, m), *SPLIT_QKVG]:

        def main(i, t_qkvg=t_qkvg):
            ops.qkvg_gemm(t_qkvg, i)

        for i in range(len(weights)):  # compile everything before capture
            main(i)
            side(i)
        main(0)
        ref = ops.xs[0].float() @ weights[0].w_qkvg.float().t()
        err = ((ops.qkvg[0].float() - ref).norm() / ref.norm()).item()
        alone = graph_time_per_layer(main) * 1e6
        stage = overlapped_time(main, side, aux) * 1e6
        print(f"M={m:2} {t_qkvg.key():20} smem {t_qkvg.smem_bytes() // 1024:3} KB rel.err {err:.1e} "
              f"alone {alone:6.2f} us stage {stage:6.2f} us (+{stage - alone:4.2f})", flush=True)
