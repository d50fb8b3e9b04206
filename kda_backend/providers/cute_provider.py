"""The CuTe DSL provider: the skinny swap-AB kernel of :mod:`kda_backend.kernels.skinny_gemm` for every role.

Supported: CUDA devices of compute capability 9.x (Hopper) and 10.x (Blackwell), bf16, M up to ``MAX_M``, N a
multiple of 8 (the last row block may be half a 16-row tile, e.g. SGLang's F_A/beta at TP16, 136 rows), K of 64,
16-byte aligned rows. The tactic per (role, M bucket) comes from the tuned tactic table when one was loaded
(:meth:`CuteDslProvider.add_tactics`), else the kernel's default.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch

from kda_backend.kernels.arrival_counters import arrival_counters
from kda_backend.kernels.compile_cache import compiled_gemms, kernel_key
from kda_backend.kernels.skinny_gemm import (
    ELEMS_PER_COPY,
    Link,
    Tactic,
    block_t_for,
    default_tactic,
    output_tiles,
    tactic_bucket,
    validate_link,
    validate_tactic,
)
from kda_backend.providers.base import GemmCall, GemmProvider, cuda_bf16_reason

MAX_M = 64
SUPPORTED_MAJORS = (9, 10)
JOINT_BLOCK_N = 16  # rows per CTA of the chained stage's joint launch (see CuteDslProvider.chained_tactics)


class CuteDslProvider(GemmProvider):
    name = "cute"
    priority = 100

    def __init__(self) -> None:
        self._tactics: dict[tuple[str, int, int, int], Tactic] = {}

    def add_tactics(self, tactics: dict[tuple[str, int, int, int], Tactic]) -> None:
        """Install tuned tactics keyed by ``(role, n, k, bucket)`` (see
        :func:`~kda_backend.kernels.skinny_gemm.tactic_bucket`; later entries win)."""
        self._tactics.update(tactics)

    def tactic(self, call: GemmCall) -> Tactic:
        for bucket in dict.fromkeys((tactic_bucket(call.m), block_t_for(call.m))):
            tuned = self._tactics.get((call.role, call.n, call.k, bucket))
            if tuned is not None:
                return tuned
        return default_tactic(call.n, call.k, call.m)

    def why_not(self, call: GemmCall) -> str | None:
        reason = cuda_bf16_reason(call, SUPPORTED_MAJORS)
        if reason is not None:
            return reason
        if call.m > MAX_M:
            return f"M > {MAX_M}"
        if importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("tvm_ffi") is None:
            return "nvidia-cutlass-dsl or apache-tvm-ffi is not installed"
        if call.n % ELEMS_PER_COPY or call.k % 64:
            return f"N={call.n} must be a multiple of {ELEMS_PER_COPY} and K={call.k} of 64"
        return validate_tactic(self.tactic(call), call.n, call.k, call.x_row_stride)

    def prepare(self, call: GemmCall) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        tactic = self.tactic(call)
        compiled_gemms.get(kernel_key(tactic, call.n, call.k, call.x_row_stride, call.w_row_stride, device))
        if tactic.split_k > 1:
            arrival_counters.reserve(device)

    def run(self, role: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        _check_aligned(role, {"x": x, "w": w, "out": out})
        if not out.is_contiguous():
            raise ValueError(f"{role}: out must be contiguous [M, N], got stride {out.stride()}")
        launch(self.tactic(_calls(x, {role: (w, x)})[role]), x, w, out)

    def chained_tactics(self, calls: dict[str, GemmCall]) -> tuple[Tactic, Tactic]:
        """The joint launch's tactic (QKVG's with 16-row CTAs, or the 16-row default where that one cannot join
        F_A/beta) and the waiting launch's (F_B's, with activations from L2 and without split-K, see
        :class:`Link`). F_B waits for F_A/beta's tiles, so those must end early: with QKVG's 48-row CTAs, three CTAs
        carried F_A/beta's whole 2 MB and ended after QKVG's (measured on H200 for Kimi-K3 TP8: 39.7-40.1 us per
        layer at M = 2..16, against 22.9-24.1 with 16-row CTAs in the session before and 23.6-26.0 at M = 1..16 in
        the session after, benchmarks/RESULTS.md)."""
        qkvg, fab, fb = calls["qkvg"], calls["fab"], calls["fb"]
        joint = dataclasses.replace(self.tactic(qkvg), block_n=JOINT_BLOCK_N)
        if validate_tactic(joint, qkvg.n, qkvg.k, qkvg.x_row_stride) or validate_link(Link(joint_rows=fab.n), joint):
            joint = default_tactic(qkvg.n, qkvg.k, qkvg.m)
        waiting = dataclasses.replace(self.tactic(fb).with_activations_from_l2(), split_k=1)
        return joint, waiting

    def trailing_tactics(self, calls: dict[str, GemmCall]) -> tuple[Tactic, Tactic]:
        """F_A/beta's and F_B's tactics, with activations from L2 (see :meth:`run_trailing`)."""
        fab = dataclasses.replace(self.tactic(calls["fab"]), x_via_l1=False)
        fb = self.tactic(calls["fb"]).with_activations_from_l2()
        return fab, fb

    def why_not_trailing(self, calls: dict[str, GemmCall]) -> str | None:
        fab, fb = self.trailing_tactics(calls)
        return (self._why_not_each(calls) or validate_link(Link(signals=True, x_ready=True), fab)
                or validate_link(Link(waits=True), fb))

    def prepare_trailing(self, calls: dict[str, GemmCall]) -> None:
        fab, fb = self.trailing_tactics(calls)
        _compile_linked(((fab, calls["fab"], Link(signals=True, x_ready=True)), (fb, calls["fb"], Link(waits=True))))

    def run_trailing(
        self, x: torch.Tensor, weights: dict[str, torch.Tensor], fab: torch.Tensor, g1: torch.Tensor
    ) -> None:
        w_fab, w_fb = weights["fab"], weights["fb"]
        _check_aligned("trailing side chain", {"x": x, "w_fab": w_fab, "w_fb": w_fb, "fab": fab, "g1": g1})
        calls = _calls(x, {"fab": (w_fab, x), "fb": (w_fb, fab[:, : w_fb.shape[1]])})
        launch_trailing(*self.trailing_tactics(calls), x, w_fab, fab, w_fb, g1)

    def why_not_chained(self, calls: dict[str, GemmCall]) -> str | None:
        reason = self._why_not_each(calls)
        if reason is not None:
            return reason
        if calls["fab"].w_row_stride != calls["qkvg"].w_row_stride:
            return "F_A/beta's weight rows must have QKVG's stride (one launch reads both)"
        joint, waiting = self.chained_tactics(calls)
        fb = calls["fb"]
        return (validate_link(Link(joint_rows=calls["fab"].n), joint) or validate_link(Link(waits=True), waiting)
                or validate_tactic(waiting, fb.n, fb.k, fb.x_row_stride))

    def prepare_chained(self, calls: dict[str, GemmCall]) -> None:
        joint, waiting = self.chained_tactics(calls)
        _compile_linked(((joint, calls["qkvg"], Link(joint_rows=calls["fab"].n)),
                         (waiting, calls["fb"], Link(waits=True))))

    def _why_not_each(self, calls: dict[str, GemmCall]) -> str | None:
        """The first role's reason this provider cannot serve its GEMM at all, named by role."""
        for call in calls.values():
            reason = self.why_not(call)
            if reason is not None:
                return f"{call.role}: {reason}"
        return None

    def run_chained(
        self, x: torch.Tensor, weights: dict[str, torch.Tensor], qkvg: torch.Tensor, fab: torch.Tensor,
        g1: torch.Tensor,
    ) -> None:
        w_qkvg, w_fab, w_fb = weights["qkvg"], weights["fab"], weights["fb"]
        _check_aligned("chained stage", {"x": x, "w_qkvg": w_qkvg, "w_fab": w_fab, "w_fb": w_fb, "qkvg": qkvg,
                                         "fab": fab, "g1": g1})
        calls = _calls(x, {"qkvg": (w_qkvg, x), "fab": (w_fab, x), "fb": (w_fb, fab[:, : w_fb.shape[1]])})
        joint, waiting = self.chained_tactics(calls)
        launch_chained(joint, waiting, x, w_qkvg, qkvg, w_fab, fab, w_fb, g1)


def _compile_linked(launches: tuple[tuple[Tactic, GemmCall, Link], ...]) -> None:
    """Compile a linked pair's kernels and reserve the counters they share (before any capture)."""
    device = torch.device("cuda", torch.cuda.current_device())
    for tactic, call, link in launches:
        compiled_gemms.get(kernel_key(tactic, call.n, call.k, call.x_row_stride, call.w_row_stride, device, link))
    arrival_counters.reserve(device)


def _check_aligned(what: str, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if t.data_ptr() % 16:
            raise ValueError(f"{what}: {name} data pointer is not 16-byte aligned")


def _calls(x: torch.Tensor, operands: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, GemmCall]:
    """The call of each role from its (weight, activations) on the device at hand (capability is not needed to
    pick a tactic)."""
    return {
        role: GemmCall(role, x.shape[0], w.shape[0], w.shape[1], x.dtype, "cuda", None, xs.stride(0), w.stride(0))
        for role, (w, xs) in operands.items()
    }


def launch(tactic: Tactic, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """``out[M, N] = x @ w.T`` with one tactic (compiled on first use; never inside a capture)."""
    n, k = w.shape
    kernel = compiled_gemms.get(kernel_key(tactic, n, k, x.stride(0), w.stride(0), x.device))
    if tactic.split_k == 1:
        kernel(x, w, out.t())
        return
    kernel(x, w, out.t(), *_split_k_operands(tactic, x, n))


def _split_k_operands(tactic: Tactic, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 workspace view (N, M, split_k) and the current stream's arrival counters for one split-K launch."""
    m = x.shape[0]
    counters = arrival_counters.for_stream(torch.cuda.current_stream(x.device), output_tiles(tactic, n, m))
    workspace = torch.empty(tactic.split_k, m, n, device=x.device, dtype=torch.float32)
    return workspace.permute(2, 1, 0), counters


def launch_trailing(
    fab_tactic: Tactic, fb_tactic: Tactic, x: torch.Tensor, w_fab: torch.Tensor, fab: torch.Tensor,
    w_fb: torch.Tensor, g1: torch.Tensor,
) -> None:
    """The side chain right behind QKVG's launch on the same stream: ``fab = x @ w_fab.T`` launched as soon as every
    QKVG CTA passed its wait for x, then ``g1 = fab[:, :K] @ w_fb.T`` (K = w_fb's columns) as soon as ``fab``'s tiles
    are stored (see :class:`~kda_backend.kernels.skinny_gemm.Link`). The tactics must be the forked side chain's with
    activations from L2: the same arithmetic, so the same bits."""
    m, n, k = x.shape[0], w_fab.shape[0], w_fab.shape[1]
    first = compiled_gemms.get(
        kernel_key(fab_tactic, n, k, x.stride(0), w_fab.stride(0), x.device, Link(signals=True, x_ready=True))
    )
    f_a = fab[:, : w_fb.shape[1]]
    second = compiled_gemms.get(
        kernel_key(fb_tactic, w_fb.shape[0], w_fb.shape[1], f_a.stride(0), w_fb.stride(0), x.device, Link(waits=True))
    )
    chain = arrival_counters.chain_for_stream(torch.cuda.current_stream(x.device))
    first(x, w_fab, fab.t(), *_split_k_operands(fab_tactic, x, n), chain)
    second(f_a, w_fb, g1.t(), chain, output_tiles(fab_tactic, n, m))


def launch_chained(
    joint: Tactic, waiting: Tactic, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, w2: torch.Tensor,
    out2: torch.Tensor, w3: torch.Tensor, out3: torch.Tensor,
) -> None:
    """The chained stage on the current stream: ``out = x @ w.T`` and ``out2 = x @ w2.T`` in one launch, then
    ``out3 = out2[:, :K3] @ w3.T`` (K3 = w3's columns) in a second that starts loading as soon as ``out2`` is stored
    (see :class:`~kda_backend.kernels.skinny_gemm.Link`). ``w2`` has ``w``'s row stride; compiled on first use."""
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    link = Link(joint_rows=w2.shape[0])
    first = compiled_gemms.get(kernel_key(joint, n, k, x.stride(0), w.stride(0), x.device, link))
    x3 = out2[:, : w3.shape[1]]
    second = compiled_gemms.get(
        kernel_key(waiting, w3.shape[0], w3.shape[1], x3.stride(0), w3.stride(0), x.device, Link(waits=True))
    )
    chain = arrival_counters.chain_for_stream(torch.cuda.current_stream(x.device))
    first(x, w, out.t(), w2, out2.t(), chain)
    second(x3, w3, out3.t(), chain, output_tiles(joint, link.joint_rows, m))
