"""Diagnostic: can split-K QKVG tactics (wider CTAs, each reading a part of x, reduced in-kernel) beat the default
16-row tactic, alone and inside the overlapped stage? (TP8; F_A/beta and F_B on their default tactics.)

Usage (GPU machine): python benchmarks/diag_qkvg_split.py 1,8,16
"""

import sys

import torch

from kda_backend.autotune import make_weight_copies
from kda_backend.geometry import preset
from kda_backend.kernels.skinny_gemm import Tactic, default_tactic
from kda_backend.overlap import OverlapScheduler
from kda_backend.providers.cute_provider import launch
from kda_backend.timing import graph_time_per_layer

SPLIT_QKVG = [Tactic(32, 128, 16, 4, split_k=2), Tactic(32, 128, 16, 5, split_k=2), Tactic(64, 64, 16, 6, split_k=4),
              Tactic(32, 256, 16, 2, split_k=2), Tactic(64, 128, 16, 3, split_k=4), Tactic(32, 128, 16, 4, split_k=4)]

g = preset("kimi-k3", 8)
weights = make_weight_copies(g, torch.device("cuda"))
c = len(weights)
aux = torch.cuda.Stream()
for m in [int(v) for v in sys.argv[1].split(",")]:
    t_fab = default_tactic(g.fab_rows, g.hidden_size, m)
    t_fb = default_tactic(g.local_width, g.head_dim, m)
    xs = [torch.randn(m, g.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(c)]
    qkvg = [torch.empty(m, g.qkvg_rows, device="cuda", dtype=torch.bfloat16) for _ in range(c)]
    fab = [torch.empty(m, g.fab_rows, device="cuda", dtype=torch.bfloat16) for _ in range(c)]
    g1 = [torch.empty(m, g.local_width, device="cuda", dtype=torch.bfloat16) for _ in range(c)]
    schedulers = [OverlapScheduler() for _ in range(24)]

    def side(i):
        launch(t_fab, xs[i % c], weights[i % c].w_fab, fab[i % c])
        launch(t_fb, fab[i % c][:, : g.head_dim], weights[i % c].w_fb, g1[i % c])

    for t_qkvg in [default_tactic(g.qkvg_rows, g.hidden_size, m), *SPLIT_QKVG]:

        def main(i, t_qkvg=t_qkvg):
            launch(t_qkvg, xs[i % c], weights[i % c].w_qkvg, qkvg[i % c])

        for i in range(c):  # compile everything before capture
            main(i)
            side(i)
        ref = xs[0].float() @ weights[0].w_qkvg.float().t()
        main(0)
        err = ((qkvg[0].float() - ref).norm() / ref.norm()).item()
        alone = graph_time_per_layer(main) * 1e6
        stage = graph_time_per_layer(lambda i: schedulers[i].run(lambda: main(i), lambda: side(i), aux)) * 1e6
        print(f"M={m:2} {t_qkvg.key():20} smem {t_qkvg.smem_bytes() // 1024:3} KB rel.err {err:.1e} "
              f"alone {alone:6.2f} us stage {stage:6.2f} us (+{stage - alone:4.2f})", flush=True)
