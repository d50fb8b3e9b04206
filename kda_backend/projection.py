"""``KDAProjection``: the projection stage of one KDA layer over zero-copy weight views.

``forward(x)`` with x ``[M, hidden]`` returns ``(qkvg [M, 4*hD], g1 [M, hD], beta_raw [M, h])`` in the weights'
dtype. Per M the plan says whether the F_A/beta -> F_B chain overlaps the QKVG GEMM on an aux stream, runs chained
behind it on the same stream (:attr:`~kda_backend.plan.Step.chained`) or after it, and which provider serves each
GEMM. The fork happens only when the host says it is legal (a full CUDA graph is being captured); otherwise the same
kernels run on one stream, so eager and replayed results are bit-identical: the side chain still runs beside QKVG
where the provider can trail it behind its own QKVG launch (:meth:`GemmProvider.run_trailing`), else after it.

When the plan leaves a step sequential and both big GEMMs fall to the torch provider over a packed weight, one
``torch.mm`` over the packed ``[QKVG; FAB]`` tensor serves both (engines' own sequential path, bit for bit).
"""

from __future__ import annotations

import torch

from kda_backend import dispatch
from kda_backend.geometry import KDAGeometry
from kda_backend.log import warn_once
from kda_backend.overlap import OverlapScheduler
from kda_backend.plan import AUTO, Plan, Step
from kda_backend.plugins import hooks
from kda_backend.providers.base import ROLES, GemmCall, GemmProvider
from kda_backend.weights import ProjectionWeights


class KDAProjection:
    """The projection stage of one layer.

    :param weights: validated views (packed or split).
    :param plan: per-M choices; the default plan is sequential with automatic providers.
    :param aux_stream: the stream the side chain forks onto (e.g. the engine's per-model aux stream); ``None``
        asks the host through the ``kda_host_aux_stream`` hook.
    """

    def __init__(
        self, weights: ProjectionWeights, plan: Plan | None = None, aux_stream: torch.cuda.Stream | None = None
    ) -> None:
        self.weights = weights
        self.plan = plan or Plan()
        self.aux_stream = aux_stream
        self._scheduler = OverlapScheduler()
        self._chosen: dict[tuple[str, int], GemmProvider] = {}
        self._chained: dict[int, GemmProvider | None] = {}
        self._trailing: dict[int, GemmProvider | None] = {}

    @property
    def geometry(self) -> KDAGeometry:
        return self.weights.geometry

    def validate_input(self, x: torch.Tensor) -> None:
        """Raise ``ValueError`` naming what is wrong with ``x`` (before anything is launched)."""
        w = self.weights
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != self.geometry.hidden_size:
            raise ValueError(f"x: shape {tuple(x.shape)} != expected [M, {self.geometry.hidden_size}]")
        if x.dtype != w.dtype:
            raise ValueError(f"x: dtype {x.dtype} != weight dtype {w.dtype}")
        if x.device != w.device:
            raise ValueError(f"x: device {x.device} != weight device {w.device}")
        if x.shape[0] > 0 and x.stride(1) != 1:
            raise ValueError(f"x: stride {x.stride()} must be unit along hidden")

    def provider(self, role: str, m: int) -> GemmProvider:
        """The provider serving ``role`` at ``m`` tokens (selected once per (role, M), then cached)."""
        key = (role, m)
        if key not in self._chosen:
            call = self.gemm_call(role, m)
            name = self.plan.step(m).provider(role)
            forced = None if name == AUTO else name
            while True:
                provider = dispatch.select(call, forced=forced)
                try:
                    provider.prepare(call)
                    break
                except Exception as exc:
                    # A kernel that cannot compile must not take serving down: the next provider serves.
                    if forced is not None or dispatch.is_forced(role) or provider.name == "torch":
                        raise
                    dispatch.mark_broken(provider, f"prepare failed: {type(exc).__name__}: {exc}")
            self._chosen[key] = provider
        return self._chosen[key]

    def chained_provider(self, m: int) -> GemmProvider | None:
        """The provider serving the chained stage at ``m`` tokens (the step's ``qkvg`` provider, or with ``auto``
        the first that can), selected and prepared once per M; ``None`` (one warning) when no provider can, and
        the three GEMMs then run one after another."""
        if m not in self._chained:
            calls = {role: self.gemm_call(role, m) for role in ROLES}
            name = self.plan.step(m).qkvg
            chosen = None
            if name != AUTO:
                chosen = dispatch.provider_by_name(name)
                reason = chosen.why_not_chained(calls)
                if reason is not None:
                    raise ValueError(f"plan provider {name!r} cannot run the chained stage at M={m}: {reason}")
                chosen.prepare_chained(calls)
            else:
                reasons = []
                for provider in hooks.gemm_providers():
                    reason = dispatch.broken_reason(provider.name) or provider.why_not_chained(calls)
                    if reason is None:
                        try:
                            provider.prepare_chained(calls)
                        except Exception as exc:
                            reason = f"chained stage: prepare failed: {type(exc).__name__}: {exc}"
                            dispatch.mark_broken(provider, reason)
                            reasons.append(f"{provider.name}: {reason}")
                            continue
                        chosen = provider
                        break
                    reasons.append(f"{provider.name}: {reason}")
                if chosen is None:
                    why = "; ".join(reasons)
                    warn_once(f"no-chained-{why}", f"no provider can run the chained stage at M={m} ({why}): its GEMMs "
                              "run one after another")
            self._chained[m] = chosen
        return self._chained[m]

    def trailing_provider(self, m: int) -> GemmProvider | None:
        """The provider that runs an overlapped step's side chain behind its own QKVG launch on one stream at ``m``
        tokens (where the host does not allow a fork): the one serving all three GEMMs, if it can; else ``None``
        and the side chain runs after QKVG."""
        if m not in self._trailing:
            provider = self.provider("qkvg", m)
            same = provider is self.provider("fab", m) and provider is self.provider("fb", m)
            calls = {role: self.gemm_call(role, m) for role in ROLES}
            chosen = None
            if same and dispatch.broken_reason(provider.name) is None and provider.why_not_trailing(calls) is None:
                try:
                    provider.prepare_trailing(calls)
                    chosen = provider
                except Exception as exc:
                    dispatch.mark_broken(provider, f"trailing side chain: prepare failed: {type(exc).__name__}: {exc}")
            self._trailing[m] = chosen
        return self._trailing[m]

    def prepare(self, ms: range | list[int]) -> None:
        """Select (and compile) providers for every M in ``ms``; call before CUDA-graph capture. Chained steps
        prepare the per-GEMM providers too: they serve if the chained stage fails."""
        for m in ms:
            if self.plan.step(m).chained:
                self.chained_provider(m)
            for role in ROLES:
                self.provider(role, m)
            if self.plan.step(m).overlap:
                self.trailing_provider(m)

    def forward(
        self,
        x: torch.Tensor,
        qkvg_out: torch.Tensor | None = None,
        fab_out: torch.Tensor | None = None,
        g1_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project ``x [M, hidden]`` -> ``(qkvg [M, 4*hD], g1 [M, hD], beta_raw [M, h])``.

        :param qkvg_out: optional contiguous ``[M, 4*hD]`` buffer to write qkvg into.
        :param fab_out: optional contiguous ``[M, fab_rows]`` buffer for F_A/beta (beta_raw is a view into it).
        :param g1_out: optional contiguous ``[M, hD]`` buffer for g1.

        qkvg is contiguous, or a view with row stride ``packed_rows`` on the packed single-GEMM path (taken only
        when no output buffers are given); beta_raw is always a strided view into the F_A/beta output.
        """
        self.validate_input(x)
        g, w = self.geometry, self.weights
        m = x.shape[0]
        outs = {"qkvg_out": (qkvg_out, g.qkvg_rows), "fab_out": (fab_out, g.fab_rows), "g1_out": (g1_out, g.local_width)}
        for name, (buf, cols) in outs.items():
            if buf is not None:
                self._validate_output(name, buf, m, cols, x)
        step = self.plan.step(m)
        if m == 0:
            fab = x.new_empty(0, g.fab_rows)
            return x.new_empty(0, g.qkvg_rows), x.new_empty(0, g.local_width), fab[:, g.head_dim : g.fab_rows_used]
        g1 = x.new_empty(m, g.local_width) if g1_out is None else g1_out
        if qkvg_out is None and fab_out is None and self._use_packed_mm(step, m):
            out = x.new_empty(m, g.packed_rows)
            self.provider("qkvg", m).run("qkvg", x, w.packed, out)
            qkvg, fab = out[:, : g.qkvg_rows], out[:, g.qkvg_rows :]
            self._run("fb", fab[:, : g.head_dim], w.w_fb, g1)
            return qkvg, g1, fab[:, g.head_dim : g.fab_rows_used]

        qkvg = x.new_empty(m, g.qkvg_rows) if qkvg_out is None else qkvg_out
        fab = x.new_empty(m, g.fab_rows) if fab_out is None else fab_out
        if step.chained and self._run_chained(x, qkvg, fab, g1):
            return qkvg, g1, fab[:, g.head_dim : g.fab_rows_used]

        def main() -> None:
            self._run("qkvg", x, w.w_qkvg, qkvg)

        def side() -> None:
            self._run("fab", x, w.w_fab, fab)
            self._run("fb", fab[:, : g.head_dim], w.w_fb, g1)

        aux = None
        if step.overlap and x.device.type == "cuda" and hooks.fork_allowed(x.device):
            aux = self.aux_stream or hooks.aux_stream(x.device)
            if aux == torch.cuda.current_stream(x.device):
                # torch hands out pooled streams round-robin, so a host's aux stream can alias the capture stream.
                warn_once("aux-is-current", f"the aux stream {aux} is the current stream: the side chain runs on it "
                          "without a fork (the same kernels, same results)")
                aux = None
        if aux is not None:
            self._scheduler.run(main, side, aux)
        else:
            main()
            if not (step.overlap and self._run_trailing(x, fab, g1)):
                side()
        return qkvg, g1, fab[:, g.head_dim : g.fab_rows_used]

    __call__ = forward

    @staticmethod
    def _validate_output(name: str, buf: torch.Tensor, m: int, cols: int, x: torch.Tensor) -> None:
        if tuple(buf.shape) != (m, cols):
            raise ValueError(f"{name}: shape {tuple(buf.shape)} != expected ({m}, {cols})")
        if buf.dtype != x.dtype or buf.device != x.device:
            raise ValueError(f"{name}: {buf.dtype} on {buf.device} != x's {x.dtype} on {x.device}")
        if not buf.is_contiguous():
            raise ValueError(f"{name}: must be contiguous, got stride {buf.stride()}")

    def _use_packed_mm(self, step: Step, m: int) -> bool:
        return (
            self.weights.packed is not None
            and not step.overlap
            and (not step.chained or self.chained_provider(m) is None)
            and self.provider("qkvg", m).name == "torch"
            and self.provider("fab", m).name == "torch"
        )

    def gemm_call(self, role: str, m: int) -> GemmCall:
        """The GEMM ``role`` performs at ``m`` tokens, with the strides the real operands will have."""
        g, w = self.geometry, self.weights
        weight = {"qkvg": w.w_qkvg, "fab": w.w_fab, "fb": w.w_fb}[role]
        device = w.device
        return GemmCall(
            role=role,
            m=m,
            n=weight.shape[0],
            k=weight.shape[1],
            dtype=w.dtype,
            device_type=device.type,
            capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
            x_row_stride=g.fab_rows if role == "fb" else g.hidden_size,
            w_row_stride=weight.stride(0),
        )

    def _run_chained(self, x: torch.Tensor, qkvg: torch.Tensor, fab: torch.Tensor, g1: torch.Tensor) -> bool:
        """Run the chained stage; ``False`` when no provider can, so the caller runs the GEMMs one by one."""
        m = x.shape[0]
        provider = self.chained_provider(m)
        if provider is None or dispatch.broken_reason(provider.name) is not None:  # as in _run_trailing
            return False
        w = self.weights
        try:
            provider.run_chained(x, {"qkvg": w.w_qkvg, "fab": w.w_fab, "fb": w.w_fb}, qkvg, fab, g1)
        except Exception as exc:
            if self.plan.step(m).qkvg != AUTO:
                raise
            self._drop(provider, f"chained stage: {type(exc).__name__}: {exc}")
            return False
        return True

    def _run_trailing(self, x: torch.Tensor, fab: torch.Tensor, g1: torch.Tensor) -> bool:
        """Run the side chain trailing QKVG's launch; ``False`` when no provider can, so the caller runs it after."""
        provider = self.trailing_provider(x.shape[0])
        # Another layer may have seen this provider fail since it was cached here (one launch of a pair may have
        # left the stream's chain counters behind): never use it again.
        if provider is None or dispatch.broken_reason(provider.name) is not None:
            return False
        w = self.weights
        try:
            provider.run_trailing(x, {"fab": w.w_fab, "fb": w.w_fb}, fab, g1)
        except Exception as exc:
            self._drop(provider, f"trailing side chain: {type(exc).__name__}: {exc}")
            return False
        return True

    def _run(self, role: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        m = x.shape[0]
        provider = self.provider(role, m)
        try:
            provider.run(role, x, w, out)
        except Exception as exc:
            if provider.name == "torch" or self.plan.step(m).provider(role) != AUTO or dispatch.is_forced(role):
                raise
            self._drop(provider, f"{type(exc).__name__}: {exc}")
            self._run(role, x, w, out)

    def _drop(self, provider: GemmProvider, reason: str) -> None:
        """Mark ``provider`` broken (one warning) and forget every choice of it here, so the next call selects
        again; automatic selection never picks it again in any layer."""
        dispatch.mark_broken(provider, reason)
        self._chosen = {k: v for k, v in self._chosen.items() if v is not provider}
        self._chained = {m: v for m, v in self._chained.items() if v is not provider}
        self._trailing = {m: v for m, v in self._trailing.items() if v is not provider}
