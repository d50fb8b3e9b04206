"""Shared by the tools in this folder: rotating per-layer operands of the projection stage at M tokens, the three
GEMMs on them, QKVG timed with a side chain forked beside it, tactics named on the command line, and the CUDA check.

Not a tool itself: ``qkvg_tactics.py``, ``side_chain.py`` and ``stage_timeline.py`` import it (run them as scripts,
``python benchmarks/tools/<tool>.py``, so this folder is on ``sys.path``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from kda_backend.autotune import make_weight_copies
from kda_backend.geometry import KDAGeometry, preset
from kda_backend.kernels.skinny_gemm import Tactic, block_t_for, default_tactic
from kda_backend.kernels.tactics import AnyTactic
from kda_backend.kernels.wgmma_gemm import WgmmaTactic
from kda_backend.overlap import OverlapScheduler
from kda_backend.plan import Plan, PlanError
from kda_backend.plan_store import read_file
from kda_backend.providers.cute_provider import launch
from kda_backend.timing import LAYERS, graph_time_per_layer
from kda_backend.weights import ProjectionWeights

TACTIC_KEY = re.compile(r"n(\d+)k(\d+)s(\d+)(?:x(\d+))?(p?)(L?)(T?)(B?)")
WGMMA_KEY = re.compile(r"w(\d+)k(\d+)(?:t(\d+))?s(\d+)(?:x(\d+))?(m?)(?:c(\d+))?(p?)")
TACTIC_HELP = (
    "tactic keys whose token tile follows M: n<rows>k<block_k>s<stages>[x<split>][p][L][T][B] for the "
    "mma.sync kernel, e.g. n48k256s4p = 48 weight rows per CTA, 256-element K-tiles, 4 stages, PDL; x14 = split-K "
    "14, L = activations through L1, T = by TMA, B = by bulk copies; w<rows>k<block_k>[t<tokens>]s<stages>[x<split>]"
    "[m][c<cluster>][p] for the wgmma kernel (QKVG on Hopper), e.g. w64k64s9p = 64 weight rows per CTA, 64-element "
    "K-tiles, 9 stages, PDL; m = tokens on the MMA's M side; c2 = with m, token tiles in clusters of 2 sharing the "
    "weight tiles by multicast; t64 = 64-token tiles along grid y instead of the tile covering M"
)


def parse_tactic(spec: str, m: int) -> AnyTactic:
    """A tactic from its key (see :data:`TACTIC_HELP`): its token tile covers ``m`` unless a ``wgmma`` key fixes it
    (``t<tokens>``, the rest of M along grid y)."""
    wgmma = WGMMA_KEY.fullmatch(spec)
    if wgmma is not None:
        rows, block_k, block_t, stages, split, tokens_on_m, cluster, pdl = wgmma.groups()
        tactic = WgmmaTactic(int(rows), int(block_k), int(block_t or 64), int(stages), int(split or 1),
                             tokens_on_m == "m", pdl == "p", int(cluster or 1))
        return tactic if block_t else tactic.for_tokens(m)
    match = TACTIC_KEY.fullmatch(spec)
    if match is None:
        raise SystemExit(f"tactic {spec!r} does not read as n<rows>k<block_k>s<stages>[x<split>][p][L][T][B] or "
                         "w<rows>k<block_k>[t<tokens>]s<stages>[x<split>][m][c<cluster>][p]")
    rows, block_k, stages, split, pdl, l1, tma, bulk = match.groups()
    return Tactic(
        block_n=int(rows), block_k=int(block_k), block_t=block_t_for(m), stages=int(stages), pdl=pdl == "p",
        x_via_l1=l1 == "L", split_k=int(split or 1), x_tma=tma == "T", x_bulk=bulk == "B",
    )


def role_shape(g: KDAGeometry, role: str) -> tuple[int, int]:
    """``(N, K)`` of the GEMM ``role`` (``qkvg``, ``fab`` or ``fb``) performs in geometry ``g``."""
    return {"qkvg": (g.qkvg_rows, g.hidden_size), "fab": (g.fab_rows, g.hidden_size),
            "fb": (g.local_width, g.head_dim)}[role]


def tactic_or_default(spec: str | None, role: str, g: KDAGeometry, m: int) -> AnyTactic:
    """The tactic ``spec`` names (see :data:`TACTIC_HELP`), else ``role``'s default tactic at ``m`` tokens."""
    return parse_tactic(spec, m) if spec else default_tactic(*role_shape(g, role), m)


def kimi_k3(tp_size: int = 8) -> tuple[KDAGeometry, list[ProjectionWeights], torch.cuda.Stream]:
    """After the CUDA check: Kimi-K3's geometry at ``tp_size`` ranks, its rotating weight copies and a stream to fork
    onto."""
    require_cuda()
    g = preset("kimi-k3", tp_size)
    return g, make_weight_copies(g, torch.device("cuda")), torch.cuda.Stream()


def token_counts(spec: str) -> list[int]:
    """``"1,8,16"`` -> ``[1, 8, 16]`` (argparse type)."""
    try:
        ms = [int(v) for v in spec.split(",")]
    except ValueError:
        raise SystemExit(f"token counts {spec!r} must be comma-separated integers") from None
    if not ms or min(ms) < 1:
        raise SystemExit(f"token counts {spec!r} must be positive")
    return ms


def require_cuda() -> None:
    """Exit with status 2 and a clear message where there is no CUDA device (as ``kda-backend bench`` does)."""
    if not torch.cuda.is_available():
        print("CUDA is not available on this machine: nothing can be measured here", file=sys.stderr)
        raise SystemExit(2)


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

    def qkvg_cublas(self, i: int) -> None:
        """QKVG of layer ``i`` on cuBLAS (``torch.mm``)."""
        j = i % self.copies
        torch.mm(self.xs[j], self.weights[j].w_qkvg.t(), out=self.qkvg[j])

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


def read_plan(path: Path, name: str) -> Plan:
    """The plan stored at ``path``; exits naming the argument ``name``, the file and the problem if it is unreadable."""
    try:
        return read_file(path)[1]
    except (OSError, PlanError) as exc:
        raise SystemExit(f"{name} {path}: {exc}") from None
