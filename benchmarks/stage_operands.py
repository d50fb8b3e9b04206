"""Shared by the stage diagnostics (``diag_overlap_parts.py``, ``diag_qkvg_tactics.py``, ``diag_stage_timeline.py``):
rotating per-layer operands of the projection stage at M tokens, the three GEMMs on them, timing QKVG with a side
chain forked beside it, and tactics named on the command line."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from kda_backend.kernels.skinny_gemm import Tactic, block_t_for
from kda_backend.overlap import OverlapScheduler
from kda_backend.providers.cute_provider import launch
from kda_backend.timing import graph_time_per_layer
from kda_backend.weights import ProjectionWeights

LAYERS = 24  # layers per timed graph (graph_time_per_layer's default)
TACTIC_KEY = re.compile(r"n(\d+)k(\d+)s(\d+)(?:x(\d+))?(p?)(L?)(T?)(B?)")


def parse_tactic(spec: str, m: int) -> Tactic:
    """A tactic from its key without the token tile, which follows ``m``: ``n48k256s6pL`` = 48 rows, 256-element
    K-tiles, 6 stages, PDL, x via L1; ``x2`` = split-K 2, ``T`` = x by TMA, ``B`` = x by bulk copies."""
    match = TACTIC_KEY.fullmatch(spec)
    if match is None:
        raise SystemExit(f"tactic {spec!r} does not read as n<rows>k<block_k>s<stages>[x<split>][p][L][T][B]")
    rows, block_k, stages, split, pdl, l1, tma, bulk = match.groups()
    return Tactic(int(rows), int(block_k), block_t_for(m), int(stages), pdl == "p", l1 == "L", int(split or 1),
                  tma == "T", bulk == "B")


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
