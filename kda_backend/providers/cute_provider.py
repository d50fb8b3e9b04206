"""The CuTe DSL provider: the skinny swap-AB kernel of :mod:`kda_backend.kernels.skinny_gemm` for every role.

Two kernel families (:mod:`kda_backend.kernels.tactics`): the skinny ``mma.sync`` kernel of
:mod:`kda_backend.kernels.skinny_gemm` for every role on SM 9.x (Hopper) and 10.x (Blackwell) up to 64 tokens, and
the ``wgmma`` kernel of :mod:`kda_backend.kernels.wgmma_gemm` for QKVG on SM 9.x up to 256 tokens. bf16, N a multiple
of 8 (the last row block may be partial, e.g. SGLang's F_A/beta at TP16, 136 rows), K of 64, 16-byte aligned rows.
A call's tactic is the one its plan tuned (:attr:`~kda_backend.providers.base.GemmCall.tuned`), else the default.

Launches are lean: :meth:`CuteDslProvider.launcher` resolves a call's tactic and compiled kernel once (with split-K
also a workspace and arrival counters per stream), so a call is the TVM-FFI launch alone, and so is the
side chain trailing QKVG (:meth:`CuteDslProvider.trailing_launcher`). Launches make no Python checks: the TVM-FFI
function checks every tensor's dtype, device, static shape, strides and 16-byte alignment in C before it launches,
and raises ``ValueError`` or ``TypeError``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kda_backend.accuracy import output_error
from kda_backend.kernels.arrival_counters import arrival_counters
from kda_backend.kernels.compile_cache import (
    FusedStageKey,
    SideChainKey,
    StageKey,
    compiled_gemms,
    kernel_key,
    target_arch,
)
from kda_backend.kernels.side_chain_gemm import why_not_one_launch, why_not_one_launch_stage
from kda_backend.kernels.skinny_gemm import (
    ELEMS_PER_COPY,
    MMA_SHAPE,
    NO_LINK,
    Link,
    Tactic,
    output_tiles,
    validate_link,
    validate_tactic,
)
from kda_backend.kernels.tactics import (
    WGMMA_MAJORS,
    AnyTactic,
    default_for,
    for_m,
    max_m,
    validate_any,
    why_not_for,
)
from kda_backend.kernels.wgmma_gemm import SMS, WgmmaTactic
from kda_backend.kernels.wgmma_stage import STAGE_COUNTERS, fused_stage_tactic, validate_stage, why_no_fused_tactic
from kda_backend.log import warn_once
from kda_backend.providers.base import (
    GemmCall,
    GemmProvider,
    Launcher,
    StageLauncher,
    TrailingLauncher,
    cuda_bf16_reason,
)

SUPPORTED_MAJORS = (9, 10)
SIGNALS = Link(signals=True, x_ready=True)  # F_A/beta trailing QKVG on its stream
WAITS = Link(waits=True)  # F_B behind it
STAGE_TOKEN_TILE = 16  # the one-launch stage serves one token tile of 16 (see CuteDslProvider.why_not_stage)


class CuteDslProvider(GemmProvider):
    name = "cute"
    priority = 100

    def __init__(self, cache_dir: Callable[[], Path] | None = None) -> None:
        """:param cache_dir: the cache folder, asked whenever a kernel is first needed; compiled kernels are kept in
            its ``kernels`` folder for later processes. ``None``: kernels are kept in memory only."""
        self._cache_dir = cache_dir
        # Launchers by call and device, shared by every layer: one split-K workspace per stream for all of them
        # (launches on one stream run in order), not one per layer and M.
        self._launchers: dict[tuple[GemmCall, torch.device], Launcher] = {}
        self._trailing: dict[tuple[GemmCall, GemmCall, torch.device], TrailingLauncher] = {}
        self._stages: dict[tuple[GemmCall, GemmCall, GemmCall, torch.device], StageLauncher | None] = {}
        self._fused: dict[tuple[GemmCall, GemmCall, GemmCall, torch.device], StageLauncher] = {}

    def kernel_folder(self) -> Path | None:
        """Where compiled kernels are kept on disk, or ``None`` (memory only)."""
        return None if self._cache_dir is None else self._cache_dir() / "kernels"

    def tactic(self, call: GemmCall) -> AnyTactic:
        """The plan's tactic for ``call`` (:meth:`~kda_backend.plan.Plan.tactic_for`) as it runs ``call.m`` tokens,
        else the default (:func:`~kda_backend.kernels.tactics.default_for`)."""
        if isinstance(call.tuned, (Tactic, WgmmaTactic)):
            return for_m(call.tuned, call.m)
        return default_for(call.role, call.n, call.k, call.m, call.capability)

    def why_not(self, call: GemmCall) -> str | None:
        reason = cuda_bf16_reason(call, SUPPORTED_MAJORS)
        if reason is not None:
            return reason
        if call.m > max_m(call.role, call.capability):
            return f"M > {max_m(call.role, call.capability)}"
        if importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("tvm_ffi") is None:
            return "nvidia-cutlass-dsl or apache-tvm-ffi is not installed"
        if call.n % ELEMS_PER_COPY or call.k % 64 or call.w_row_stride % ELEMS_PER_COPY:
            return (f"N={call.n} and the weight row stride {call.w_row_stride} must be multiples of "
                    f"{ELEMS_PER_COPY}, K={call.k} of 64")
        tactic = self.tactic(call)
        tuned = isinstance(call.tuned, (Tactic, WgmmaTactic))
        return why_not_for(tactic, call.role, call.m, call.capability, tuned) or validate_any(
            tactic, call.n, call.k, call.x_row_stride)

    def prepare(self, call: GemmCall) -> None:
        device = _current_device()
        tactic = self.tactic(call)
        self._kernel(tactic, call, device)
        if tactic.uses_workspace:
            arrival_counters.reserve(device)

    def launcher(self, call: GemmCall) -> Launcher:
        """``(x [M, K], w [N, K], out [M, N])`` -> ``out = x @ w.T`` on the current stream, for ``call``'s M, N, K and
        row strides on the current device: the tactic and kernel are resolved here (compiled by :meth:`prepare`), a
        split-K launch's workspace and counters once per stream. One launcher per call serves every layer."""
        device = _current_device()
        found = self._launchers.get((call, device))
        if found is None:
            found = self._launchers[(call, device)] = self._new_launcher(call, device)
        return found

    def _new_launcher(self, call: GemmCall, device: torch.device) -> Launcher:
        tactic = self.tactic(call)
        kernel = self._kernel(tactic, call, device)
        if not tactic.uses_workspace:

            def launch_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
                kernel(x, w, out, None, None, None, None)

            return launch_gemm
        workspace = PerStream(lambda stream: _workspace_operands(tactic, call.m, call.n, stream), device)

        def launch_with_workspace(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
            kernel(x, w, out, *workspace.current(), None, None)

        return launch_with_workspace

    def run(self, role: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        _check_aligned(role, {"x": x, "w": w, "out": out})
        if not out.is_contiguous():
            raise ValueError(f"{role}: out must be contiguous [M, N], got stride {out.stride()}")
        launch(self.tactic(_calls(x, {role: (w, x)})[role]), x, w, out, self.kernel_folder())

    def trailing_tactics(self, calls: dict[str, GemmCall]) -> tuple[Tactic, Tactic]:
        """F_A/beta's and F_B's tactics, with activations from L2 (see :meth:`trailing_launcher`)."""
        fab = dataclasses.replace(self.tactic(calls["fab"]), x_via_l1=False)
        fb = self.tactic(calls["fb"]).with_activations_from_l2()
        return fab, fb

    def why_not_trailing(self, calls: dict[str, GemmCall]) -> str | None:
        for call in calls.values():
            reason = self.why_not(call)
            if reason is not None:
                return f"{call.role}: {reason}"
        fab, fb = self.trailing_tactics(calls)
        if self.tactic(calls["qkvg"]).uses_workspace and fab.split_k > 1:
            # F_A/beta starts beside QKVG without waiting for it (x_ready) and counts its tiles in on the stream's
            # split-K arrival counters, which a split-K QKVG is still using.
            return "qkvg and fab both count tiles in: they would share the stream's arrival counters at once"
        return validate_link(SIGNALS, fab) or validate_link(WAITS, fb)

    def trailing_launcher(self, calls: dict[str, GemmCall]) -> TrailingLauncher:
        """See :meth:`GemmProvider.trailing_launcher`: ``fab = x @ w_fab.T`` launched as soon as every QKVG CTA
        passed its wait for x, then ``g1 = fab[:, :D] @ w_fb.T`` as soon as ``fab``'s tiles are stored (see
        :class:`~kda_backend.kernels.skinny_gemm.Link`): one launch of both where their tactics allow
        (:mod:`~kda_backend.kernels.side_chain_gemm`), else two. The tactics are the forked side chain's with
        activations from L2: the same arithmetic, so the same bits. One launcher per pair of calls serves every
        layer."""
        key = (calls["fab"], calls["fb"], _current_device())
        found = self._trailing.get(key)
        if found is None:
            found = self._trailing[key] = self._new_trailing_launcher(calls)
        return found

    def _new_trailing_launcher(self, calls: dict[str, GemmCall]) -> TrailingLauncher:
        fab_call, fb_call = calls["fab"], calls["fb"]
        fab_tactic, fb_tactic = self.trailing_tactics(calls)
        reason = validate_link(SIGNALS, fab_tactic) or validate_link(WAITS, fb_tactic)
        if reason is not None:
            raise ValueError(f"trailing side chain: {reason}")
        device = _current_device()
        per_stream = _side_chain_operands(fab_tactic, fab_call, device)
        # One launch where the tactics allow and its first-use check can run (not inside a capture: a launcher first
        # built there takes the two-launch form, the same bits).
        one_launch = why_not_one_launch(fab_tactic, fb_tactic) is None and fb_call.x_row_stride == fab_call.n
        if one_launch and not torch.cuda.is_current_stream_capturing():
            fab_key = kernel_key(fab_tactic, fab_call.n, fab_call.k, fab_call.x_row_stride, fab_call.w_row_stride,
                                 device)
            key = SideChainKey(fab_key, fb_tactic, fb_call.n, fb_call.k, fb_call.w_row_stride)
            chain_kernel = compiled_gemms.get(key, self.kernel_folder())

            def run_one_launch(
                x: torch.Tensor, w_fab: torch.Tensor, fab: torch.Tensor, w_fb: torch.Tensor, g1: torch.Tensor
            ) -> None:
                chain_kernel(x, w_fab, fab, w_fb, g1, *per_stream.current())

            reason = one_launch_error(run_one_launch, fab_call, fb_call, device)
            if reason is None:
                return run_one_launch
            warn_once(f"one-launch-{key}", f"side chain trailing QKVG at M={fab_call.m}: one launch of "
                      f"{fab_tactic.key()} and {fb_tactic.key()} computed wrongly on {device} ({reason}); "
                      "it runs as two launches")
        first = self._kernel(fab_tactic, fab_call, device, SIGNALS)
        second = self._kernel(fb_tactic, fb_call, device, WAITS)
        expected = output_tiles(fab_tactic, fab_call.n, fab_call.m)  # F_A/beta's tiles, what F_B waits for
        d = fb_call.k

        def run(x: torch.Tensor, w_fab: torch.Tensor, fab: torch.Tensor, w_fb: torch.Tensor, g1: torch.Tensor) -> None:
            work, arrivals, chain = per_stream.current()
            first(x, w_fab, fab, work, arrivals, chain, None)
            try:
                second(fab.narrow(1, 0, d), w_fb, g1, None, None, chain, expected)
            except Exception:
                # F_A/beta counts its tiles in on chain[0] and only F_B resets it: zero it behind F_A/beta, or the
                # stream's next side chain would find its count reached before its own tiles are stored.
                chain.zero_()
                raise

        return run

    def stage_tactic(self, calls: dict[str, GemmCall]) -> Tactic | None:
        """QKVG's tactic in the one-launch stage: the plan's ``mma.sync`` tactic with activations by ``cp.async``,
        in 16-row CTAs where it runs another thread count than the side chain. Each output's K order stays the
        plan's, so its bits do too (the first-use check compares them). ``None`` where QKVG runs the ``wgmma`` kernel
        or splits K, whose sums run in another order."""
        qkvg = self.tactic(calls["qkvg"])
        if not isinstance(qkvg, Tactic) or qkvg.split_k > 1:
            return None
        fab, _ = self.trailing_tactics(calls)
        block_n = qkvg.block_n if qkvg.threads == fab.threads else MMA_SHAPE[0]
        return dataclasses.replace(qkvg, block_n=block_n, x_tma=False, x_bulk=False)

    def why_not_stage(self, calls: dict[str, GemmCall]) -> str | None:
        """``None`` if :meth:`stage_launcher` serves ``calls``, else why not."""
        reason = self.why_not_trailing(calls)
        if reason is not None:
            return reason
        qkvg = self.stage_tactic(calls)
        if qkvg is None:
            return "QKVG runs the wgmma kernel or splits K"
        if qkvg.block_t != STAGE_TOKEN_TILE:
            # Over two or more token tiles QKVG's 16-row CTAs take several waves: at 32 tokens the one launch took
            # 46.6 us of GPU time on an H200 against 26.7 us for QKVG with its trailing side chain.
            return f"M > {STAGE_TOKEN_TILE}: the one launch is slower on the GPU than the launches it saves the host"
        if calls["fb"].x_row_stride != calls["fab"].n:
            return "F_B reads F_A from another buffer than F_A/beta's output"
        q = calls["qkvg"]
        return why_not_one_launch_stage(qkvg, *self.trailing_tactics(calls)) or validate_tactic(
            qkvg, q.n, q.k, q.x_row_stride)

    def stage_launcher(self, calls: dict[str, GemmCall]) -> StageLauncher | None:
        """See :meth:`GemmProvider.stage_launcher`: :class:`~kda_backend.kernels.side_chain_gemm.StageGemm`, checked
        on its first use against this provider's launchers (:func:`stage_error`); one that differs gives a warning
        and ``None``."""
        if torch.cuda.is_current_stream_capturing() or self.why_not_stage(calls) is not None:
            return None
        key = (calls["qkvg"], calls["fab"], calls["fb"], _current_device())
        if key not in self._stages:
            self._stages[key] = self._new_stage_launcher(calls)
        return self._stages[key]

    def _new_stage_launcher(self, calls: dict[str, GemmCall]) -> StageLauncher | None:
        q, fab_call, fb_call = calls["qkvg"], calls["fab"], calls["fb"]
        qkvg_tactic = self.stage_tactic(calls)
        fab_tactic, fb_tactic = self.trailing_tactics(calls)
        device = _current_device()
        per_stream = _side_chain_operands(fab_tactic, fab_call, device)
        fab_key = kernel_key(fab_tactic, fab_call.n, fab_call.k, fab_call.x_row_stride, fab_call.w_row_stride, device)
        key = StageKey(SideChainKey(fab_key, fb_tactic, fb_call.n, fb_call.k, fb_call.w_row_stride), qkvg_tactic,
                       q.n, q.w_row_stride)
        try:
            kernel = compiled_gemms.get(key, self.kernel_folder())
        except Exception as exc:  # the stage's own kernel only: its separate launches still serve
            warn_once(f"stage-{key}", f"projection stage at M={q.m} in one launch did not compile on {device} "
                      f"({type(exc).__name__}: {exc}); eager calls launch QKVG and its side chain")
            return None

        def run_stage(x: torch.Tensor, w_qkvg: torch.Tensor, qkvg: torch.Tensor, w_fab: torch.Tensor,
                      fab: torch.Tensor, w_fb: torch.Tensor, g1: torch.Tensor) -> None:
            kernel(x, w_qkvg, qkvg, w_fab, fab, w_fb, g1, *per_stream.current())

        separate = {role: self.launcher(call) for role, call in calls.items()}
        reason = stage_error(run_stage, separate, calls, device)
        if reason is None:
            return run_stage
        warn_once(f"stage-{key}", f"projection stage at M={q.m} in one launch ({qkvg_tactic.key()} beside "
                  f"{fab_tactic.key()} and {fb_tactic.key()}) differs from its separate launches on {device} "
                  f"({reason}); eager calls launch QKVG and its side chain")
        return None

    def why_not_fused(self, calls: dict[str, GemmCall]) -> str | None:
        """``None`` if :meth:`fused_launcher` serves ``calls``: Hopper, contiguous weights and activations, F_B
        reading F_A/beta's output, and the shapes of :func:`~kda_backend.kernels.wgmma_stage.plan_stage` on this
        device's SMs."""
        q, fab, fb = calls["qkvg"], calls["fab"], calls["fb"]
        reason = cuda_bf16_reason(q, WGMMA_MAJORS)
        if reason is not None:
            return f"fused stage: {reason}"
        if (q.x_row_stride, q.w_row_stride, fab.k, fab.w_row_stride, fb.w_row_stride) != (q.k, q.k, q.k, q.k, fb.k):
            return "fused stage: x and the weights must have contiguous rows of the hidden size (F_B's of D)"
        if fb.x_row_stride != fab.n:
            return "fused stage: F_B reads F_A from another buffer than F_A/beta's output"
        reason = why_no_fused_tactic(q.n, q.k, q.m)
        if reason is not None:
            return f"fused stage: {reason}"
        return validate_stage(fused_stage_tactic(q.n, q.k, q.m), q.n, fab.n, fb.n, q.k, fb.k, _sms())

    def fused_launcher(self, calls: dict[str, GemmCall]) -> StageLauncher:
        """See :meth:`GemmProvider.fused_launcher`: :class:`~kda_backend.kernels.wgmma_stage.WgmmaStage`, its
        counters the current stream's chain counters, checked on first use against fp32 (:func:`fused_error`)."""
        reason = self.why_not_fused(calls)
        if reason is not None:
            raise ValueError(reason)
        device = _current_device()
        key = (calls["qkvg"], calls["fab"], calls["fb"], device)
        if key not in self._fused:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"fused stage at M={calls['qkvg'].m} was not built before CUDA-graph capture; "
                                   "call prepare() first")
            self._fused[key] = self._new_fused_launcher(calls, device)
        return self._fused[key]

    def _new_fused_launcher(self, calls: dict[str, GemmCall], device: torch.device) -> StageLauncher:
        q, fab, fb = calls["qkvg"], calls["fab"], calls["fb"]
        key = FusedStageKey(fused_stage_tactic(q.n, q.k, q.m), q.n, fab.n, fb.n, q.k, fb.k, _sms(),
                            target_arch(device))
        kernel = compiled_gemms.get(key, self.kernel_folder())
        arrival_counters.reserve(device)
        counters = PerStream(lambda stream: (arrival_counters.chain_for_stream(stream)[:STAGE_COUNTERS],), device)

        def run_fused(x: torch.Tensor, w_qkvg: torch.Tensor, qkvg: torch.Tensor, w_fab: torch.Tensor,
                      fab: torch.Tensor, w_fb: torch.Tensor, g1: torch.Tensor) -> None:
            kernel(x, w_qkvg, qkvg, w_fab, fab, w_fb, g1, *counters.current())

        reason = fused_error(run_fused, calls, device)
        if reason is not None:
            raise RuntimeError(f"fused stage at M={q.m} ({key.qkvg.key()}) is wrong on {device}: {reason}")
        return run_fused

    def _kernel(self, tactic: AnyTactic, call: GemmCall, device: torch.device, link: Link = NO_LINK) -> Any:
        key = kernel_key(tactic, call.n, call.k, call.x_row_stride, call.w_row_stride, device, link)
        return compiled_gemms.get(key, self.kernel_folder())


def _side_chain_operands(fab_tactic: Tactic, fab_call: GemmCall, device: torch.device) -> PerStream:
    """Each stream's ``(work, arrivals, chain)`` for a side chain on it: F_A/beta's split-K workspace and arrival
    counters (``None`` unsplit) and the stream's chain counters."""
    arrival_counters.reserve(device)

    def operands(stream: torch.cuda.Stream) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        split = fab_tactic.split_k > 1
        work, arrivals = _workspace_operands(fab_tactic, fab_call.m, fab_call.n, stream) if split else (None, None)
        return work, arrivals, arrival_counters.chain_for_stream(stream)

    return PerStream(operands, device)


class PerStream:
    """Operands each stream needs its own of (a split-K workspace, counters), made by ``make(stream)`` on the
    stream's first launch and kept: the current stream's when built, so those are made outside any CUDA-graph
    capture. A stream first seen inside a capture gets them from the capture's memory pool, where they stay
    allocated, held here, for every replay and later launch."""

    def __init__(self, make: Callable[[torch.cuda.Stream], tuple], device: torch.device) -> None:
        self._make = make
        self._device = device
        self._by_stream: dict[int, tuple] = {}
        # The raw handle of the current stream, without building a torch Stream object per launch.
        self._raw_stream = torch._C._cuda_getCurrentRawStream
        self.current()

    def current(self) -> tuple:
        """The current stream's operands."""
        operands = self._by_stream.get(self._raw_stream(self._device.index))
        if operands is None:
            stream = torch.cuda.current_stream(self._device)
            operands = self._by_stream[stream.cuda_stream] = self._make(stream)
        return operands


def one_launch_error(run: TrailingLauncher, fab_call: GemmCall, fb_call: GemmCall, device: torch.device) -> str | None:
    """Why the one-launch side chain ``run`` must not serve on ``device``, or ``None``: run twice on random
    operands of the calls' shapes, outputs poisoned with NaN, F_A/beta's and F_B's outputs against fp32
    (:func:`~kda_backend.accuracy.output_error`), the two runs bitwise equal and the stream's counters
    zero after them. Checked once per launcher, outside any capture, before it serves: the kernel has a first use
    on every device, and a wrong one then costs a warning and a launch per call instead of wrong results. A
    failing check leaves the stream's counters zeroed for the two-launch form."""
    m, n, k, d = fab_call.m, fab_call.n, fab_call.k, fb_call.k

    def compare(stream: torch.cuda.Stream) -> str | None:
        randn = _random_rows(device)
        x = randn(m, fab_call.x_row_stride, 1.0)[:, :k]
        w_fab = randn(n, fab_call.w_row_stride, k**-0.5)[:, :k]
        w_fb = randn(fb_call.n, fb_call.w_row_stride, d**-0.5)[:, :d]
        runs = []
        for _ in range(2):
            fab, g1 = (torch.full((m, cols), float("nan"), device=device, dtype=torch.bfloat16)
                       for cols in (n, fb_call.n))
            run(x, w_fab, fab, w_fb, g1)
            runs.append((fab, g1))
        stream.synchronize()
        fab, g1 = runs[0]
        reason = (output_error(fab, x.float() @ w_fab.float().t())
                  or output_error(g1, fab[:, :d].float() @ w_fb.float().t()))
        if reason is None and not all(torch.equal(a, b) for a, b in zip(*runs)):
            reason = "two runs differ"
        return reason

    return _first_use_error(compare, device)


def stage_error(
    run: StageLauncher, separate: dict[str, Launcher], calls: dict[str, GemmCall], device: torch.device
) -> str | None:
    """Why the one-launch stage ``run`` must not serve on ``device``, or ``None``: on random operands of the calls'
    shapes, its three outputs (poisoned with NaN, two runs) against those of the ``separate`` launchers of the
    same calls, bit for bit (what a graph of the stage computes), and the stream's counters zero after them.
    Checked once per launcher, outside any capture, before it serves. A failing check leaves the stream's counters
    zeroed."""
    q, fab_call, fb_call = calls["qkvg"], calls["fab"], calls["fb"]
    m, d = q.m, fb_call.k

    def compare(stream: torch.cuda.Stream) -> str | None:
        randn = _random_rows(device)
        x = randn(m, q.x_row_stride, 1.0)[:, : q.k]
        w_qkvg = randn(q.n, q.w_row_stride, q.k**-0.5)[:, : q.k]
        w_fab = randn(fab_call.n, fab_call.w_row_stride, q.k**-0.5)[:, : q.k]
        w_fb = randn(fb_call.n, fb_call.w_row_stride, d**-0.5)[:, :d]
        expected = [torch.empty(m, n, device=device, dtype=torch.bfloat16) for n in (q.n, fab_call.n, fb_call.n)]
        separate["qkvg"](x, w_qkvg, expected[0])
        separate["fab"](x, w_fab, expected[1])
        separate["fb"](expected[1].narrow(1, 0, d), w_fb, expected[2])
        runs = []
        for _ in range(2):
            outs = [torch.full_like(e, float("nan")) for e in expected]
            run(x, w_qkvg, outs[0], w_fab, outs[1], w_fb, outs[2])
            runs.append(outs)
        stream.synchronize()
        return next((f"{role} differs from its separate launch" for outs in runs
                     for role, out, e in zip(("qkvg", "fab", "fb"), outs, expected) if not torch.equal(out, e)), None)

    return _first_use_error(compare, device)


def fused_error(run: StageLauncher, calls: dict[str, GemmCall], device: torch.device) -> str | None:
    """Why the fused stage ``run`` must not serve on ``device``, or ``None``: run twice on random operands of the
    calls' shapes, outputs poisoned with NaN, each output against fp32 (F_B's from the stage's own F_A/beta output,
    :func:`~kda_backend.accuracy.output_error`), the two runs bitwise equal and the stream's counters zero after
    them. Checked once per launcher, outside any capture, before it serves."""
    q, fab_call, fb_call = calls["qkvg"], calls["fab"], calls["fb"]
    m, d = q.m, fb_call.k

    def compare(stream: torch.cuda.Stream) -> str | None:
        randn = _random_rows(device)
        x = randn(m, q.k, 1.0)
        w_qkvg, w_fab = randn(q.n, q.k, q.k**-0.5), randn(fab_call.n, q.k, q.k**-0.5)
        w_fb = randn(fb_call.n, d, d**-0.5)
        runs = []
        for _ in range(2):
            outs = [torch.full((m, n), float("nan"), device=device, dtype=torch.bfloat16)
                    for n in (q.n, fab_call.n, fb_call.n)]
            run(x, w_qkvg, outs[0], w_fab, outs[1], w_fb, outs[2])
            runs.append(outs)
        stream.synchronize()
        qkvg, fab, g1 = runs[0]
        reason = (output_error(qkvg, x.float() @ w_qkvg.float().t()) or output_error(fab, x.float() @ w_fab.float().t())
                  or output_error(g1, fab[:, :d].float() @ w_fb.float().t()))
        if reason is None and not all(torch.equal(a, b) for a, b in zip(*runs)):
            reason = "two runs differ"
        return reason

    return _first_use_error(compare, device)


def _sms() -> int:
    """SMs of the current device (the fused stage's grid divides them), else those of an H100 / H200 SXM."""
    if not torch.cuda.is_available():
        return SMS
    return torch.cuda.get_device_properties(_current_device()).multi_processor_count


def _first_use_error(compare: Callable[[torch.cuda.Stream], str | None], device: torch.device) -> str | None:
    """``compare(stream)``'s reason on the current stream (a raise is one too: a launch the device refuses), else
    one if the stream's chain counters were not left at zero; a failing check leaves the stream's counters
    zeroed."""
    stream = torch.cuda.current_stream(device)
    try:
        reason = compare(stream)
        if reason is None and arrival_counters.chain_for_stream(stream).any():
            reason = "its chain counters were not left at zero"
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
    if reason is not None:
        _zero_counters(stream)
    return reason


def _random_rows(device: torch.device) -> Callable[[int, int, float], torch.Tensor]:
    """``randn(rows, cols, scale)``: bf16 normal rows drawn from a generator of its own, so the host's random
    state (an engine's sampling) stays as it was."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(rows: int, cols: int, scale: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen, device=device) * scale).bfloat16()

    return randn


def _zero_counters(stream: torch.cuda.Stream) -> None:
    """The stream's chain and split-K arrival counters back to zero after a launch that may have left them set."""
    arrival_counters.chain_for_stream(stream).zero_()
    arrival_counters.for_stream(stream, 1).zero_()


def _current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _check_aligned(what: str, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if t.data_ptr() % 16:
            raise ValueError(f"{what}: {name} data pointer is not 16-byte aligned")


def trailing_calls(x: torch.Tensor, w_fab: torch.Tensor, fab: torch.Tensor, w_fb: torch.Tensor) -> dict[str, GemmCall]:
    """The ``fab`` and ``fb`` calls of a side chain over these operands, for
    :meth:`CuteDslProvider.trailing_launcher`."""
    return _calls(x, {"fab": (w_fab, x), "fb": (w_fb, fab[:, : w_fb.shape[1]])})


def _calls(x: torch.Tensor, operands: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, GemmCall]:
    """The call of each role from its (weight, activations) on the device at hand, without a capability: its default
    tactic is the ``mma.sync`` kernel's, which serves every role (:func:`~kda_backend.kernels.tactics.default_for`)."""
    return {
        role: GemmCall(role, x.shape[0], w.shape[0], w.shape[1], x.dtype, "cuda", None, xs.stride(0), w.stride(0))
        for role, (w, xs) in operands.items()
    }


def _workspace_operands(
    tactic: AnyTactic, m: int, n: int, stream: torch.cuda.Stream
) -> tuple[torch.Tensor, torch.Tensor]:
    """A split-K launch's fp32 workspace (:meth:`~kda_backend.kernels.wgmma_gemm.WgmmaTactic.
    workspace_shape`) and ``stream``'s arrival counters."""
    workspace = torch.empty(tactic.workspace_shape(m, n), device=stream.device, dtype=torch.float32)
    return workspace, arrival_counters.for_stream(stream, tactic.counters(n, m))


def launch(
    tactic: AnyTactic, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, folder: Path | None = None
) -> None:
    """``out[M, N] = x @ w.T`` with one tactic on the current stream (autotuning, tools): the kernel compiled, or
    loaded from ``folder``, on first use (never inside a capture), a split-K workspace per call. Serving launches
    through :meth:`CuteDslProvider.launcher`."""
    n, k = w.shape
    kernel = compiled_gemms.get(kernel_key(tactic, n, k, x.stride(0), w.stride(0), x.device), folder)
    if not tactic.uses_workspace:
        kernel(x, w, out, None, None, None, None)
        return
    stream = torch.cuda.current_stream(x.device)
    kernel(x, w, out, *_workspace_operands(tactic, x.shape[0], n, stream), None, None)
