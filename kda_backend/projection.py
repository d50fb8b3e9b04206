"""``KDAProjection``: the projection stage of one KDA layer over zero-copy weight views.

``forward(x)`` with x ``[M, hidden]`` returns ``(qkvg [M, 4*hD], g1 [M, hD], beta_raw [M, h])`` in the weights'
dtype. The first call at an M turns the plan's step for that M into a stage (:mod:`kda_backend.stages`): the
provider serving each GEMM, chosen by :mod:`kda_backend.dispatch` and compiled, bound into launchers, and whether
the side chain runs beside QKVG, or the whole stage as one fused launch. Later calls at that M validate the input,
allocate the outputs and run the stage.

A provider that fails while compiling or launching is dropped (one warning) and the stage rebuilt without it, down
to the torch provider, which always serves; a provider the plan or ``KDA_BACKEND_PROVIDER`` forces fails loudly.
The fork onto the aux stream happens only when the host says it is legal (a CUDA graph is being captured); the
other paths run the same kernels, so eager and replayed results are bit-identical.
"""

from __future__ import annotations

import dataclasses

import torch

from kda_backend import dispatch
from kda_backend.geometry import KDAGeometry
from kda_backend.kernels.arrival_counters import arrival_counters
from kda_backend.log import info_once, warn_once
from kda_backend.overlap import fork_while_capturing
from kda_backend.plan import AUTO, SEQUENTIAL_TORCH, Plan
from kda_backend.providers.base import ROLES, GemmCall, GemmProvider, StageLauncher, TrailingLauncher
from kda_backend.stages import FusedStage, Gemm, LaunchFailed, OverlappedStage, PackedStage, SequentialStage
from kda_backend.weights import ProjectionWeights, require_tensor

OUTPUT_ALIGN_BYTES = 16  # the CuTe kernels store 16-byte vectors


class KDAProjection:
    """The projection stage of one layer.

    :param weights: validated views (packed or split).
    :param plan: per-M choices; the default plan is sequential with automatic providers.
    :param aux_stream: the stream the side chain forks onto (e.g. the engine's per-model aux stream); ``None``
        asks the host through the ``kda_host_aux_stream`` hook.
    :param for_tuning: a candidate the autotuner times inside its own CUDA graphs. Its overlapped steps fork exactly
        while a graph is being captured, whatever the host would answer: tuning measures the forked form, which
        the engines' decode graphs run (SGLang, for one, allows the fork only in its capture mode, and tuning at
        load is not in it). No forms for calls without a fork are built (the side chain trailing QKVG's launch,
        the whole stage in one launch): only eager and piecewise serving runs them, each compiles kernels of its
        own, and each checks itself against the separate launches on first use.
    """

    def __init__(
        self,
        weights: ProjectionWeights,
        plan: Plan | None = None,
        aux_stream: torch.cuda.Stream | None = None,
        for_tuning: bool = False,
    ) -> None:
        self.weights = weights
        self.for_tuning = for_tuning
        self._hidden, self._dtype, self._device = weights.geometry.hidden_size, weights.dtype, weights.device
        self.plan = plan or Plan()
        self.aux_stream = aux_stream
        self._chosen: dict[tuple[str, int], GemmProvider] = {}
        self._serves: dict[int, bool] = {}
        # M -> (the stage, the packed single-GEMM stage where one serves calls without output buffers).
        self._stages: dict[int, tuple[SequentialStage | FusedStage, PackedStage | None]] = {}

    @property
    def geometry(self) -> KDAGeometry:
        return self.weights.geometry

    def validate_input(self, x: torch.Tensor) -> None:
        """Raise ``TypeError`` / ``ValueError`` naming what is wrong with ``x`` (before anything is launched)."""
        # One expression for the accepted case (every eager call pays it); the checks below name what is wrong.
        if (isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] == self._hidden and x.dtype == self._dtype
                and x.device == self._device and (x.stride(1) == 1 or not x.shape[0])):
            return
        w = self.weights
        require_tensor("x", x)
        if x.dim() != 2 or x.shape[1] != self.geometry.hidden_size:
            raise ValueError(f"x: shape {tuple(x.shape)} != expected [M, {self.geometry.hidden_size}]")
        if x.dtype != w.dtype:
            raise ValueError(f"x: dtype {x.dtype} != weight dtype {w.dtype}")
        if x.device != w.device:
            raise ValueError(f"x: device {x.device} != weight device {w.device}")
        if x.shape[0] > 0 and x.stride(1) != 1:
            raise ValueError(f"x: stride {x.stride()} must be unit along hidden")

    def gemm_call(self, role: str, m: int) -> GemmCall:
        """The GEMM ``role`` performs at ``m`` tokens, with the strides the real operands will have."""
        g, w = self.geometry, self.weights
        weight = w.of_role(role)
        device = w.device
        n, k = weight.shape
        return GemmCall(
            role=role,
            m=m,
            n=n,
            k=k,
            dtype=w.dtype,
            device_type=device.type,
            capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
            x_row_stride=g.fab_rows if role == "fb" else g.hidden_size,
            w_row_stride=weight.stride(0),
            tuned=self.plan.tactic_for(role, n, k, m),
        )

    def provider(self, role: str, m: int) -> GemmProvider:
        """The provider serving ``role`` at ``m`` tokens, selected and prepared once per (role, M); a provider
        that cannot prepare (a kernel that does not compile) is dropped and the next one serves."""
        key = (role, m)
        if key not in self._chosen:
            call = self.gemm_call(role, m)
            named = self._named_provider(role, m, call)
            while True:
                provider = dispatch.select(call, forced=named)
                try:
                    provider.prepare(call)
                    break
                except Exception as exc:
                    if self._forced(role, m) or provider.name == "torch":
                        raise
                    dispatch.mark_broken(provider, f"prepare failed: {type(exc).__name__}: {exc}")
                    named = None
            info_once(f"serves-{role}-{provider.name}",
                      f"{role} GEMM [N={call.n}, K={call.k}] served by {provider.name!r}")
            self._chosen[key] = provider
        return self._chosen[key]

    def _named_provider(self, role: str, m: int, call: GemmCall) -> str | None:
        """The provider the plan names for ``role`` at ``m``: binding where the plan was tuned for ``m``; for a step
        borrowed from a larger M (see :meth:`Plan.step`) only where that provider serves this call, else ``None``
        (automatic selection). ``KDA_BACKEND_PROVIDER`` pins win over the plan's name (one warning where they
        differ)."""
        name = self.plan.step(m).provider(role)
        pinned = dispatch.forced_providers().get(role)
        if pinned is not None:
            if name not in (AUTO, pinned):
                warn_once(f"pin-over-plan-{role}-{pinned}-{name}", f"KDA_BACKEND_PROVIDER pins {role} to {pinned!r}; "
                          f"the plan's {name!r} does not serve it")
            return pinned
        if name == AUTO or self.plan.tuned(m):
            return None if name == AUTO else name
        provider = dispatch.provider_by_name(name)
        if dispatch.broken_reason(name) is not None or dispatch.why_not(provider, call) is not None:
            return None
        return name

    def _forced(self, role: str, m: int) -> bool:
        """Whether a failure of ``role``'s provider at ``m`` must raise: the environment or a plan tuned for ``m``
        names it."""
        return dispatch.is_forced(role) or (self.plan.tuned(m) and self.plan.step(m).provider(role) != AUTO)

    def state_buffers(self) -> dict[str, torch.Tensor]:
        """The GPU tensors the kernels keep state in between launches, by buffer name: the split-K arrival
        counters (``[streams, counters]`` int32, zero whenever none of the kernels runs), once a CuTe kernel
        reserved them; ``{}`` on other devices. An engine that releases its weights' memory and maps it again
        (vLLM's sleep level 2, SGLang's memory saver) restores its model's buffers and nothing else allocated at
        load: an adapter registers these as non-persistent buffers of the layer
        (:func:`~kda_backend.serving.keep_state`)."""
        if self._device.type != "cuda":
            return {}
        arena = arrival_counters.arena(self._device)
        return {} if arena is None else {"kda_arrival_counters": arena}

    def serves(self, m: int) -> bool:
        """Whether the plan has a step of kda-backend's own for ``m`` tokens: one it covers (:meth:`Plan.covers`)
        other than sequential cuBLAS, the baseline every step was measured against. An engine adapter keeps the
        engine's own path elsewhere: no tuned plan, M above the largest tuned one, or a sequential cuBLAS step,
        where the engine's own path runs the same GEMMs or faster ones (vLLM: its packed GEMM and F_B, or its
        low-latency overlap; SGLang: its GEMMs over its split weights, or its overlap). A standalone call runs the
        plan's step or its fallback."""
        served = self._serves.get(m)
        if served is None:  # asked on every engine forward: once per M
            served = self._serves[m] = self.plan.covers(m) and self.plan.step(m) != SEQUENTIAL_TORCH
        return served

    def stage(self, m: int) -> SequentialStage | FusedStage:
        """The stage serving ``m`` tokens (built and compiled on first use)."""
        return self._stage_pair(m)[0]

    def prepare(self, ms: range | list[int]) -> None:
        """Build (and compile) the stage of every M in ``ms``; call before CUDA-graph capture."""
        for m in ms:
            self._stage_pair(m)

    def forward(
        self,
        x: torch.Tensor,
        qkvg_out: torch.Tensor | None = None,
        fab_out: torch.Tensor | None = None,
        g1_out: torch.Tensor | None = None,
        compute_fb: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Project ``x [M, hidden]`` -> ``(qkvg [M, 4*hD], g1 [M, hD], beta_raw [M, h])``.

        :param qkvg_out: optional contiguous ``[M, 4*hD]`` buffer to write qkvg into.
        :param fab_out: optional contiguous ``[M, fab_rows]`` buffer for F_A/beta (beta_raw is a view into it).
        :param g1_out: optional contiguous ``[M, hD]`` buffer for g1.
        :param compute_fb: ``False`` when the host applies F_B itself (it reads f_a from ``fab_out``): no F_B
            kernel runs and ``g1`` is ``None``; the side chain is F_A/beta alone (forked where allowed, else after
            QKVG).

        qkvg is contiguous, or a view with row stride ``packed_rows`` on the packed single-GEMM path (taken only
        when no output buffers are given); beta_raw is always a strided view into the F_A/beta output.
        """
        self.validate_input(x)
        g = self.geometry
        m = x.shape[0]
        if m and x.stride(0) != g.hidden_size:
            # Kernels take rows of exactly hidden elements (compiled for that stride); a row-strided x (every other
            # row, a slice of a wider buffer) is copied once rather than refused by a kernel mid-stage.
            x = x.clone(memory_format=torch.contiguous_format)
        if qkvg_out is not None or fab_out is not None or g1_out is not None:
            for name, buf, cols in (("qkvg_out", qkvg_out, g.qkvg_rows), ("fab_out", fab_out, g.fab_rows),
                                    ("g1_out", g1_out, g.local_width)):
                if buf is not None:
                    _validate_output(name, buf, m, cols, x)
            if not compute_fb and g1_out is not None:
                raise ValueError("g1_out: given with compute_fb=False, which computes no g1")
        g1 = None if not compute_fb else x.new_empty(m, g.local_width) if g1_out is None else g1_out
        if m == 0:
            fab = x.new_empty(0, g.fab_rows)
            return x.new_empty(0, g.qkvg_rows), g1, fab.narrow(1, g.head_dim, g.heads_local)
        while True:
            stage, packed = self._stages.get(m) or self._stage_pair(m)
            try:
                if packed is not None and qkvg_out is None and fab_out is None:
                    out = x.new_empty(m, g.packed_rows)
                    packed.run(x, self.weights, out, g1)
                    qkvg, fab = out.narrow(1, 0, g.qkvg_rows), out.narrow(1, g.qkvg_rows, g.fab_rows)
                else:
                    qkvg = x.new_empty(m, g.qkvg_rows) if qkvg_out is None else qkvg_out
                    fab = x.new_empty(m, g.fab_rows) if fab_out is None else fab_out
                    stage.run(x, self.weights, qkvg, fab, g1)
                return qkvg, g1, fab.narrow(1, g.head_dim, g.heads_local)
            except LaunchFailed as failed:
                self._recover(failed, m)

    __call__ = forward

    def _stage_pair(self, m: int) -> tuple[SequentialStage | FusedStage, PackedStage | None]:
        if m not in self._stages:
            self._check_current_device()
            step = self.plan.step(m)
            fused = self._fused(m) if step.fused else None
            if fused is not None:
                self._stages[m] = (fused, None)
                return self._stages[m]
            gemms = {role: self._gemm(role, m, self.gemm_call(role, m)) for role in ROLES}
            if step.overlap:
                trailing, trail, whole = (None, None, None) if self.for_tuning else self._trailing(m, gemms)
                stage: SequentialStage = OverlappedStage(
                    **gemms, trailing=trailing, trail=trail, whole=whole, aux_stream=self.aux_stream,
                    fork_allowed=fork_while_capturing if self.for_tuning else None,
                )
            else:
                stage = SequentialStage(**gemms)
            packed = self._packed(m, gemms) if self.weights.packed is not None and not step.overlap else None
            self._stages[m] = (stage, packed)
        return self._stages[m]

    def _check_current_device(self) -> None:
        """Raise ``RuntimeError`` where the weights live on another CUDA device than the current one: the CuTe
        kernels are compiled for the current device and launched on its current stream, so such a stage would
        launch on the wrong GPU. Checked once per M, where its stage is built (before any launch), not per call."""
        device = self._device
        if device.type != "cuda":
            return
        current = torch.device("cuda", torch.cuda.current_device())
        if device != current:
            raise RuntimeError(
                f"weights on {device} while {current} is the current CUDA device: kda-backend builds and launches its "
                f"kernels on the current device; make {device} current first (torch.cuda.set_device({device.index}) "
                f"or `with torch.cuda.device({device.index}):`)"
            )

    def _packed(self, m: int, gemms: dict[str, Gemm]) -> PackedStage | None:
        """The packed form of a sequential step over packed weights: one GEMM over ``[QKVG; FAB]`` by QKVG's
        provider, then F_B, which reads f_a inside that GEMM's wider output. Taken where QKVG and F_A/beta both run
        on torch (cuBLAS over the packed weight, vLLM's own path), or where the plan tuned QKVG's tactic at the
        packed rows and QKVG's provider serves it (the autotuner then timed the step in this form), and F_B's
        provider serves that row stride; ``None`` otherwise, or where a GEMM cannot be built (one warning: the
        step runs its GEMMs one after another)."""
        g, qkvg, fb = self.geometry, gemms["qkvg"].provider, gemms["fb"].provider
        call = dataclasses.replace(self.gemm_call("qkvg", m), n=g.packed_rows,
                                   tuned=self.plan.tactic_for("qkvg", g.packed_rows, g.hidden_size, m))
        fb_call = dataclasses.replace(self.gemm_call("fb", m), x_row_stride=g.packed_rows)
        if {qkvg.name, gemms["fab"].provider.name} != {"torch"} and (
                call.tuned is None or dispatch.why_not(qkvg, call) is not None):
            return None
        if dispatch.why_not(fb, fb_call) is not None:  # e.g. a kernel compiled for one f_a row stride
            return None
        try:
            qkvg.prepare(call)
            fb.prepare(fb_call)
            return PackedStage(Gemm("qkvg", qkvg, qkvg.launcher(call)), Gemm("fb", fb, fb.launcher(fb_call)))
        except Exception as exc:  # a plugin's provider may fail in any way; the step's separate GEMMs serve
            warn_once(f"packed-{qkvg.name}-{m}", f"packed projection GEMMs at M={m} not built by {qkvg.name!r} / "
                      f"{fb.name!r} ({type(exc).__name__}: {exc}); the step runs its GEMMs one after another")
            return None

    def _fused(self, m: int) -> FusedStage | None:
        """The fused stage of a step that asks for one, or ``None`` (one warning; the step runs as its ``overlap``
        says) where its provider cannot fuse these calls."""
        step = self.plan.step(m)
        names = {step.provider(role) for role in ROLES}
        name = names.pop() if len(names) == 1 else AUTO
        pinned = dispatch.forced_providers()
        if name == AUTO:
            reason = "it must name one provider for all three GEMMs"
        elif any(pinned.get(role, name) != name for role in ROLES):
            reason = f"KDA_BACKEND_PROVIDER pins another provider than {name!r}"
        elif dispatch.broken_reason(name) is not None:
            reason = f"provider {name!r} is broken: {dispatch.broken_reason(name)}"
        else:
            provider = dispatch.provider_by_name(name)
            calls = {role: self.gemm_call(role, m) for role in ROLES}
            try:
                reason = provider.why_not_fused(calls)
                if reason is None:
                    return FusedStage(provider, provider.fused_launcher(calls))
            except Exception as exc:  # a plugin's provider may fail in any way; the step's other form serves
                reason = f"{type(exc).__name__}: {exc}"
        warn_once(f"fused-{name}-{m}", f"fused projection stage at M={m} not taken ({reason}); the step runs "
                  f"{'overlapped' if step.overlap else 'sequentially'}")
        return None

    def _gemm(self, role: str, m: int, call: GemmCall) -> Gemm:
        provider = self.provider(role, m)
        return Gemm(role, provider, provider.launcher(call))

    def _trailing(
        self, m: int, gemms: dict[str, Gemm]
    ) -> tuple[GemmProvider | None, TrailingLauncher | None, StageLauncher | None]:
        """The provider that runs an overlapped step's side chain behind its own QKVG launch on one stream (where
        the host does not allow a fork), its bound launcher and its whole stage as one launch (eager calls; ``None``
        where it has none): the one serving all three GEMMs, if it can; else ``(None, None, None)`` and the side
        chain runs after QKVG."""
        provider = gemms["qkvg"].provider
        if any(gemm.provider is not provider for gemm in gemms.values()):
            return None, None, None
        calls = {role: self.gemm_call(role, m) for role in ROLES}
        if dispatch.broken_reason(provider.name) is not None:
            return None, None, None
        try:
            if provider.why_not_trailing(calls) is not None:
                return None, None, None
            return provider, provider.trailing_launcher(calls), provider.stage_launcher(calls)
        except Exception as exc:  # a plugin's provider may fail in any way; its GEMMs then run one after another
            warn_once(f"trailing-{provider.name}-{m}", f"provider {provider.name!r}: the side chain trailing QKVG at "
                      f"M={m} not built ({type(exc).__name__}: {exc}); without a fork the step runs its GEMMs one "
                      "after another")
            return None, None, None

    def _recover(self, failed: LaunchFailed, m: int) -> None:
        """After a launch failed: re-raise where the provider was forced (or is torch, the last resort), else mark
        it broken (one warning) and forget every stage that uses it, so the next attempt selects again."""
        provider, what, cause = failed.provider, failed.what, failed.__cause__
        if provider.name == "torch" or (what in ROLES and self._forced(what, m)):
            raise cause
        dispatch.mark_broken(provider, f"{what}: {type(cause).__name__}: {cause}")
        self._chosen = {k: v for k, v in self._chosen.items() if v is not provider}
        self._stages = {k: pair for k, pair in self._stages.items() if provider not in pair[0].providers()}


def _validate_output(name: str, buf: torch.Tensor, m: int, cols: int, x: torch.Tensor) -> None:
    if tuple(buf.shape) != (m, cols):
        raise ValueError(f"{name}: shape {tuple(buf.shape)} != expected ({m}, {cols})")
    if buf.dtype != x.dtype or buf.device != x.device:
        raise ValueError(f"{name}: {buf.dtype} on {buf.device} != x's {x.dtype} on {x.device}")
    if not buf.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got stride {buf.stride()}")
    if m and buf.data_ptr() % OUTPUT_ALIGN_BYTES:
        # Checked before any launch: a kernel would refuse it only after the ones before it ran (a trailing F_A/beta
        # that already counted its tiles in for an F_B that never runs).
        raise ValueError(f"{name}: data pointer {buf.data_ptr():#x} is not {OUTPUT_ALIGN_BYTES}-byte aligned; "
                         "accepted: a buffer from torch's allocator or a view starting at a 16-byte boundary")
