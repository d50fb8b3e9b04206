"""What a GEMM provider is: one implementation of ``out[M, N] = x[M, K] @ w[N, K]^T`` for the projection roles.

Roles of the projection stage (shapes from :class:`kda_backend.geometry.KDAGeometry`):

- ``qkvg``: x ``[M, hidden]`` @ QKVG ``[4*hD, hidden]``^T, the large memory-bound GEMM.
- ``fab``: x ``[M, hidden]`` @ FAB ``[fab_rows, hidden]``^T, skinny N.
- ``fb``: f_a ``[M, D]`` (a strided view into fab's output) @ F_B ``[hD, D]``^T, skinny K.

A provider answers :meth:`GemmProvider.why_not` per call (``None`` = supported) so dispatch can log a precise
reason, and :meth:`GemmProvider.run` writes into a caller-provided output (no allocation inside CUDA graphs).
The projection binds one :meth:`GemmProvider.launcher` per role and M, so per-call work is only the launch. A
provider may also run the overlapped side chain on QKVG's own stream (:meth:`GemmProvider.trailing_launcher`),
where the host does not allow a fork, an eager call's whole stage as one launch
(:meth:`GemmProvider.stage_launcher`), and a fused stage that a plan step names for every call
(:meth:`GemmProvider.fused_launcher`).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Hashable

import torch

ROLES = ("qkvg", "fab", "fb")

# ``launcher(x [M, K], w [N, K], out [M, N])``: one GEMM with everything that depends only on its call resolved.
Launcher = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
# ``(x [M, K], w_fab [fab_rows, K], fab [M, fab_rows], w_fb [hD, D], g1 [M, hD])``: the side chain trailing QKVG.
TrailingLauncher = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# ``(x, w_qkvg [4hD, K], qkvg [M, 4hD], w_fab, fab, w_fb, g1)``: the whole stage as one launch (eager calls).
StageLauncher = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]


@dataclasses.dataclass(frozen=True)
class GemmCall:
    """Everything a provider needs to decide whether it supports one GEMM (no tensors, so it is hashable).

    :param role: one of :data:`ROLES`.
    :param m: tokens (rows of x).
    :param n: weight rows (output features).
    :param k: reduction length.
    :param dtype: dtype of x, w and out (``torch.bfloat16`` in production).
    :param device_type: ``"cuda"`` or ``"cpu"``.
    :param capability: CUDA compute capability ``(major, minor)``, ``None`` on CPU.
    :param x_row_stride: elements between rows of x (``k`` when contiguous; larger for strided views).
    :param w_row_stride: elements between rows of w.
    :param tuned: the plan's tuned configuration of this GEMM for the provider that tuned it (the CuTe provider's
        tactic); other providers ignore it. ``None``: the provider's default.
    """

    role: str
    m: int
    n: int
    k: int
    dtype: torch.dtype
    device_type: str
    capability: tuple[int, int] | None
    x_row_stride: int
    w_row_stride: int
    tuned: Hashable | None = None


class GemmProvider(abc.ABC):
    """One GEMM implementation. Higher ``priority`` is tried first; the torch provider (priority 0) always works."""

    name: str = ""
    priority: int = 0

    @abc.abstractmethod
    def why_not(self, call: GemmCall) -> str | None:
        """``None`` if this provider can run ``call``, else a short reason (logged once by dispatch)."""

    @abc.abstractmethod
    def run(self, role: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """Compute ``out = x @ w.T`` on the current stream.

        :param x: ``[M, K]``, unit stride along K.
        :param w: ``[N, K]``, unit stride along K (a view; never copied).
        :param out: ``[M, N]``, written in full.
        """

    def prepare(self, call: GemmCall) -> None:
        """Compile or load whatever ``call`` needs; called before CUDA-graph capture, never inside it."""

    def launcher(self, call: GemmCall) -> Launcher:
        """A callable ``(x, w, out)`` computing ``out = x @ w.T`` for operands shaped and strided as ``call`` says,
        with whatever depends only on ``call`` resolved once (after :meth:`prepare`). The default calls :meth:`run`."""
        role = call.role
        return lambda x, w, out: self.run(role, x, w, out)

    def why_not_trailing(self, calls: dict[str, GemmCall]) -> str | None:
        """``None`` if this provider can run the side chain trailing its own QKVG launch for ``calls``, else why not."""
        return f"provider {self.name!r} has no trailing side chain"

    def trailing_launcher(self, calls: dict[str, GemmCall]) -> TrailingLauncher:
        """The side chain on the current stream, right behind this provider's QKVG launch and beside it, for the
        ``fab`` and ``fb`` calls in ``calls`` (their :attr:`GemmCall.tuned` included), resolved once (compiled here,
        never inside a capture): ``fab = x @ W_fab.T``, then ``g1 = fab[:, :D] @ W_fb.T``, bit for bit what the
        launchers of those calls compute (the forked side chain), without a second stream."""
        raise NotImplementedError(f"provider {self.name!r} has no trailing side chain")

    def stage_launcher(self, calls: dict[str, GemmCall]) -> StageLauncher | None:
        """The whole stage for ``calls`` as one launch on the current stream, for eager calls (no capture), where
        the host's launch cost exceeds the stage's GPU time: ``qkvg = x @ W_qkvg.T`` beside the side chain, bit for
        bit what this provider's launchers compute. Resolved once, outside any capture; ``None`` where this
        provider has none for ``calls`` (the stage then launches QKVG and its trailing side chain)."""
        return None

    def why_not_fused(self, calls: dict[str, GemmCall]) -> str | None:
        """``None`` if this provider runs the whole stage for ``calls`` as one fused launch, else why not."""
        return f"provider {self.name!r} has no fused stage"

    def fused_launcher(self, calls: dict[str, GemmCall]) -> StageLauncher:
        """The whole stage for ``calls`` as one launch on the current stream, for every call of a step that names
        it (eager, captured, forked or not): ``qkvg = x @ W_qkvg.T``, ``fab = x @ W_fab.T`` and
        ``g1 = fab[:, :D] @ W_fb.T`` with a schedule of the provider's own, so its bits need not match its separate
        launchers'. Resolved and checked once, outside any capture; raises where it cannot serve."""
        raise NotImplementedError(f"provider {self.name!r} has no fused stage")

    def __repr__(self) -> str:
        return f"<GemmProvider {self.name} priority={self.priority}>"


def cuda_bf16_reason(call: GemmCall, majors: tuple[int, ...]) -> str | None:
    """Why a bf16 CUDA kernel built for compute capabilities ``majors`` (e.g. ``(9, 10)``) cannot serve ``call``,
    or ``None`` if device, capability and dtype fit."""
    if call.device_type != "cuda":
        return f"needs a CUDA device, got {call.device_type}"
    if call.capability is None or call.capability[0] not in majors:
        return f"compute capability {call.capability} not in SM {majors}"
    if call.dtype != torch.bfloat16:
        return f"dtype {call.dtype} is not bfloat16"
    return None

