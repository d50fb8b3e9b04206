"""How one M runs the projection stage: built once per M by :class:`~kda_backend.projection.KDAProjection`, then
called with operands only.

- :class:`SequentialStage`: QKVG, then F_A/beta, then F_B, on the current stream.
- :class:`PackedStage`: one GEMM over the packed ``[QKVG; FAB]`` weight, then F_B (the engines' own sequential path,
  bit for bit); taken when the torch provider serves both big GEMMs and the caller gave no output buffers.
- :class:`OverlappedStage`: the F_A/beta -> F_B side chain beside QKVG: forked onto the aux stream while the host
  allows a fork, else trailing QKVG's launch on the same stream where one provider serves all three GEMMs
  (:meth:`~kda_backend.providers.base.GemmProvider.trailing_launcher`; an eager call outside any capture launches
  the whole stage at once where that provider can, :meth:`~kda_backend.providers.base.GemmProvider.stage_launcher`),
  else after QKVG. The same kernels' tiles, so the same bits, on every path.
- :class:`FusedStage`: the whole stage as one launch of a provider's own schedule
  (:meth:`~kda_backend.providers.base.GemmProvider.fused_launcher`), on every path: its bits are its own, the same
  eager and replayed.

A stage calls its providers' launchers directly: no selection, lookup or hook call per call except the host's fork
permission. A launcher that raises is reported as :class:`LaunchFailed`, naming its provider, so the projection can
drop that provider and rebuild the stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kda_backend.log import warn_once
from kda_backend.overlap import OverlapScheduler
from kda_backend.plugins import hooks
from kda_backend.providers.base import GemmProvider, Launcher, StageLauncher, TrailingLauncher
from kda_backend.weights import ProjectionWeights


class LaunchFailed(Exception):
    """A provider's launch raised; ``__cause__`` is its exception."""

    def __init__(self, provider: GemmProvider, what: str) -> None:
        super().__init__(f"{what}: provider {provider.name!r} failed")
        self.provider = provider
        self.what = what


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One role's provider and its bound launcher at one M."""

    role: str
    provider: GemmProvider
    launch: Launcher

    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        try:
            self.launch(x, w, out)
        except Exception as exc:
            raise LaunchFailed(self.provider, self.role) from exc


@dataclasses.dataclass
class SequentialStage:
    """QKVG, F_A/beta and F_B one after another on the current stream."""

    qkvg: Gemm
    fab: Gemm
    fb: Gemm
    mode = "sequential"

    def providers(self) -> set[GemmProvider]:
        return {self.qkvg.provider, self.fab.provider, self.fb.provider}

    def run(
        self, x: torch.Tensor, w: ProjectionWeights, qkvg: torch.Tensor, fab: torch.Tensor, g1: torch.Tensor | None
    ) -> None:
        """``qkvg [M, 4hD]``, ``fab [M, fab_rows]`` and ``g1 [M, hD]`` (``None``: no F_B) written in full."""
        self.qkvg(x, w.w_qkvg, qkvg)
        run_side_chain(self.fab, self.fb, x, w, fab, g1)


@dataclasses.dataclass
class PackedStage:
    """One GEMM over the packed weight ``[packed_rows, hidden]`` into ``out [M, packed_rows]``, then F_B."""

    packed: Gemm
    fb: Gemm

    def run(self, x: torch.Tensor, w: ProjectionWeights, out: torch.Tensor, g1: torch.Tensor | None) -> None:
        self.packed(x, w.packed, out)
        if g1 is not None:
            self.fb(out.narrow(1, w.geometry.qkvg_rows, w.geometry.head_dim), w.w_fb, g1)


@dataclasses.dataclass
class OverlappedStage(SequentialStage):
    """The side chain beside QKVG: forked where the host allows, else trailing QKVG's launch, else after it.

    :param trailing: the provider serving all three GEMMs when it can trail the side chain behind its own QKVG
        launch on one stream, else ``None``.
    :param trail: that provider's bound trailing side chain (with ``trailing``).
    :param whole: that provider's whole stage as one launch, for eager calls (``None``: it has none here). An
        eager call costs the host more than the GPU at small M, and each launch is host time; inside a capture
        the stage keeps the trailing form, whose GPU time is the tuned one.
    :param aux_stream: the fork's stream (``None``: ask the host on the first fork).
    :param fork_allowed: who answers whether this call may fork (``None``: the host, through
        ``kda_host_fork_allowed``).
    """

    trailing: GemmProvider | None = None
    trail: TrailingLauncher | None = None
    whole: StageLauncher | None = None
    aux_stream: torch.cuda.Stream | None = None
    fork_allowed: Callable[[torch.device], bool] | None = None
    scheduler: OverlapScheduler = dataclasses.field(default_factory=OverlapScheduler)
    mode = "overlap"

    def providers(self) -> set[GemmProvider]:
        return super().providers() | ({self.trailing} if self.trailing is not None else set())

    def run(
        self, x: torch.Tensor, w: ProjectionWeights, qkvg: torch.Tensor, fab: torch.Tensor, g1: torch.Tensor | None
    ) -> None:
        aux = self._fork_stream(x.device) if x.is_cuda else None
        if aux is not None:
            self.scheduler.run(
                lambda: self.qkvg(x, w.w_qkvg, qkvg), lambda: run_side_chain(self.fab, self.fb, x, w, fab, g1), aux
            )
            return
        if self.whole is not None and g1 is not None and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            try:
                self.whole(x, w.w_qkvg, qkvg, w.w_fab, fab, w.w_fb, g1)
            except Exception as exc:
                raise LaunchFailed(self.trailing, "one-launch stage") from exc
            return
        self.qkvg(x, w.w_qkvg, qkvg)
        if self.trail is not None and g1 is not None:
            try:
                self.trail(x, w.w_fab, fab, w.w_fb, g1)
            except Exception as exc:
                raise LaunchFailed(self.trailing, "trailing side chain") from exc
            return
        run_side_chain(self.fab, self.fb, x, w, fab, g1)

    def _fork_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The aux stream when a fork is allowed now (by :attr:`fork_allowed`, else by the host), else ``None``."""
        if not (hooks.fork_allowed(device) if self.fork_allowed is None else self.fork_allowed(device)):
            return None
        if self.aux_stream is None:
            self.aux_stream = hooks.aux_stream(device)
        if self.aux_stream == torch.cuda.current_stream(device):
            # torch hands out pooled streams round-robin, so a host's aux stream can alias the capture stream.
            warn_once("aux-is-current", f"the aux stream {self.aux_stream} is the current stream: the side chain "
                      "runs on it without a fork (the same kernels, same results)")
            return None
        return self.aux_stream


@dataclasses.dataclass
class FusedStage:
    """The whole stage as one launch of ``provider``'s fused launcher, forked or not, eager or captured."""

    provider: GemmProvider
    launch: StageLauncher
    mode = "fused"

    def providers(self) -> set[GemmProvider]:
        return {self.provider}

    def run(
        self, x: torch.Tensor, w: ProjectionWeights, qkvg: torch.Tensor, fab: torch.Tensor, g1: torch.Tensor | None
    ) -> None:
        """As :meth:`SequentialStage.run`; without ``g1`` F_B's output goes to a scratch buffer (the launch computes
        it beside QKVG anyway, and F_A/beta's bits stay those of every other call)."""
        if g1 is None:
            g1 = x.new_empty(x.shape[0], w.geometry.local_width)
        try:
            self.launch(x, w.w_qkvg, qkvg, w.w_fab, fab, w.w_fb, g1)
        except Exception as exc:
            raise LaunchFailed(self.provider, "fused stage") from exc


def run_side_chain(
    fab_gemm: Gemm, fb_gemm: Gemm, x: torch.Tensor, w: ProjectionWeights, fab: torch.Tensor, g1: torch.Tensor | None
) -> None:
    """``fab = x @ W_fab.T``, then (unless ``g1`` is ``None``) ``g1 = fab[:, :D] @ W_fb.T``."""
    fab_gemm(x, w.w_fab, fab)
    if g1 is not None:
        fb_gemm(fab.narrow(1, 0, w.geometry.head_dim), w.w_fb, g1)

