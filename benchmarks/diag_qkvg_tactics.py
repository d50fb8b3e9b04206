"""Diagnostic: QKVG tactics against the default, alone and inside the overlapped stage (TP8; F_A/beta and F_B on
their default tactics). Tactics are named by their keys without the token tile, which follows M (see
``stage_operands.parse_tactic``).

Usage (GPU machine): python benchmarks/diag_qkvg_tactics.py 1,8,16 n48k256s6p,n32k128s4x2pL [F_A/beta [F_B]]
(the optional third and fourth arguments replace F_A/beta's and F_B's default tactics in the side chain)
"""

import sys

import torch

from kda_backend.autotune import make_weight_copies
from kda_backend.geometry import preset
from kda_backend.kernels.skinny_gemm import default_tactic
from kda_backend.timing import copy_bandwidth, graph_time_per_layer
from stage_operands import StageOperands, overlapped_time, parse_tactic as parse

g = preset("kimi-k3", 8)
weights = make_weight_copies(g, torch.device("cuda"))
aux = torch.cuda.Stream()
bandwidth = copy_bandwidth()
qkvg_floor = weights[0].w_qkvg.numel() * 2 / bandwidth * 1e6
print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s, QKVG floor {qkvg_floor:.2f} us", flush=True)
for m in [int(v) for v in sys.argv[1].split(",")]:
    t_fab = parse(sys.argv[3], m) if len(sys.argv) > 3 else default_tactic(g.fab_rows, g.hidden_size, m)
    t_fb = parse(sys.argv[4], m) if len(sys.argv) > 4 else default_tactic(g.local_width, g.head_dim, m)
    ops = StageOperands(weights, m)

    def side(i):
        ops.fab_gemm(t_fab, i)
        ops.fb_gemm(t_fb, i)

    tactics = [default_tactic(g.qkvg_rows, g.hidden_size, m)]
    tactics += [parse(spec, m) for spec in sys.argv[2].split(",")]
    for t_qkvg in tactics:

        def main(i, t_qkvg=t_qkvg):
            ops.qkvg_gemm(t_qkvg, i)

        for i in range(len(weights)):  # compile everything before capture
            main(i)
            side(i)
        ops.qkvg[0].fill_(float("nan"))
        main(0)
        ref = ops.xs[0].float() @ weights[0].w_qkvg.float().t()
        err = ((ops.qkvg[0].float() - ref).norm() / ref.norm()).item()
        alone = graph_time_per_layer(main) * 1e6
        stage = overlapped_time(main, side, aux) * 1e6
        print(f"M={m:2} {t_qkvg.key():20} smem {t_qkvg.smem_bytes() // 1024:3} KB rel.err {err:.1e} "
              f"alone {alone:6.2f} us ({alone / qkvg_floor:.3f}x) stage {stage:6.2f} us (+{stage - alone:4.2f})",
              flush=True)
