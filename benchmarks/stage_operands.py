"""Shared by the stage diagnostics (``diag_overlap_parts.py``, ``diag_qkvg_tactics.py``): rotating per-layer operands
of the projection stage at M tokens, the three GEMMs on them, and timing QKVG with a side chain forked beside it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kda_backend.kernels.skinny_gemm import Tactic
from kda_backend.overlap import OverlapScheduler
from kda_backend.providers.cute_provider import launch
from kda_backend.timing import graph_time_per_layer
from kda_backend.weights import ProjectionWeights

LAYERS = 24  # layers per timed graph (graph_time_per_layer's default)


class StageOperands:
    """One x ``[M, hidden]`` and output set per weight copy, so layer i uses copy ``i % copies``."""

    def __init__(self, weights: list[ProjectionWeights], m: int) -> None:
        g = weights[0].geometry
        self.weights, self.copies, self.head_dim = weights, len(weights), g.head_dim

        def buffers(cols: int, fill: Callable[..., torch.Tensor] = torch.empty) -> list[torch.Tensor]:
            return [fill(m, cols, device="cuda", dtype=torch.bfloat16) for _ in weights]

        self.xs = buffers(g.hidden_size, torch.randn)
        self.qkvg, self.fab, self.g1 = buffers(g.qkvg_rows), buffers(g.fab_rows), buffers(g.local_width)

    def qkvg_gemm(self, tactic: Tactic, i: int) -> None:
        j = i % self.copies
        launch(tactic, self.xs[j], self.weights[j].w_qkvg, self.qkvg[j])

    def fab_gemm(self, tactic: Tactic, i: int) -> None:
        j = i % self.copies
        launch(tactic, self.xs[j], self.weights[j].w_fab, self.fab[j])

    def fb_gemm(self, tactic: Tactic, i: int) -> None:
        j = i % self.copies
        launch(tactic, self.fab[j][:, : self.head_dim], self.weights[j].w_fb, self.g1[j])


def overlapped_time(main: Callable[[int], None], side: Callable[[int], None], aux: torch.cuda.Stream) -> float:
    """Seconds per layer of ``main(i)`` on the current stream with ``side(i)`` forked onto ``aux`` and joined."""
    schedulers = [OverlapScheduler() for _ in range(LAYERS)]
    return graph_time_per_layer(lambda i: schedulers[i].run(lambda: main(i), lambda: side(i), aux), layers=LAYERS)
