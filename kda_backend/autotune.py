"""Measuring candidate plans on the local GPU the way serving runs them, and keeping the fastest.

Three levels, each timed inside CUDA graphs of many layers whose weights rotate over several copies (so nothing
is served from L2) - see :mod:`kda_backend.timing`:

1. CuTe tactics, per role and tactic bucket (:func:`~kda_backend.kernels.tactics.tactic_bucket`), timed at a
   few M of the bucket and chosen by their worst slowdown at any of them (:func:`most_robust`): the side chain's
   kernels alone, then QKVG (both kernel families where the device runs ``wgmma``; above 64 tokens also over the
   packed ``[QKVG; FAB]`` weight, for a sequential step's one GEMM) and the side chain's again
   inside the overlapped stage, where side chains that tie are told apart by the stage without a fork (see
   :func:`tune_tactics`).
2. Per M: overlapped or sequential x provider of QKVG x provider of the side chain (F_A/beta and F_B), and the
   fused step where a provider runs the stage as one launch, each candidate running through
   :class:`~kda_backend.projection.KDAProjection` itself, i.e. the real code path, in the forked form the engines'
   decode graphs run, whatever the host answers outside them (``for_tuning``); a fused step that ties with the
   fastest is kept (:data:`FUSED_TIE`), and sequential cuBLAS unless it is clearly beaten (:data:`NATIVE_MARGIN`).
3. Per M whose step is not sequential cuBLAS: the whole ``KimiK3DeltaAttention`` decode step under the plan and under
   sequential cuBLAS, timed in turn (:func:`confirm_in_decode_step`); the step stays only where the decode step
   gains (:data:`DECODE_STEP_MARGIN`).

Tuning compiles kernels and captures graphs, so it runs before the engine captures its own graphs, never inside.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Callable, Hashable, Iterable

import torch

from kda_backend import dispatch
from kda_backend.accuracy import output_error
from kda_backend.batch_sizes import engine_batch_sizes
from kda_backend.decode_step import DecodeStepTimer
from kda_backend.geometry import KDAGeometry
from kda_backend.kernels.occupancy import SmBudget, spare_slot_tactics
from kda_backend.kernels.skinny_gemm import Tactic, candidate_tactics, default_tactic
from kda_backend.kernels.tactics import (
    SINGLE_TOKEN_BUCKET,
    LARGE_M_SKINNY_ROLES,
    SKINNY_MAX_M,
    AnyTactic,
    for_m,
    max_m,
    tactic_bucket,
    wgmma_serves,
)
from kda_backend.kernels.wgmma_gemm import default_wgmma_tactic, leaves_room, wgmma_candidate_tactics
from kda_backend.log import warn_once
from kda_backend.plan import AUTO, SEQUENTIAL_CUBLAS, SEQUENTIAL_TORCH, Plan, Step, TacticTable
from kda_backend.plugins import hooks
from kda_backend.projection import KDAProjection
from kda_backend.providers.base import ROLES
from kda_backend.providers.cute_provider import launch
from kda_backend.reference import reference_projection
from kda_backend.timing import COPIES, LAYERS, graph_time_per_layer
from kda_backend.weights import ProjectionWeights

# Every batch size either engine captures by default (a plan answers between them by the next larger tuned M).
DEFAULT_MS = engine_batch_sizes("all")
# Representative M per tactic bucket (see kernels.tactics.tactic_bucket) for tactic tuning.
BUCKET_MS = {SINGLE_TOKEN_BUCKET: (1,), 16: (2, 8, 16), 32: (24, 32), 64: (48, 64), 128: (96, 128), 256: (192, 256)}
# wgmma QKVG candidates timed alone per bucket, and how many of them go on to the overlapped stage (besides the
# fastest one that leaves room for the side chain, see _wgmma_finalists).
WGMMA_CANDIDATES = 10
WGMMA_FINALISTS = 2
FINALISTS = 4  # in-stage candidates timed again
RETIMING_ROUNDS = 2
# Side-chain finalists whose forked stage is within this factor of the best one's at every M tie (one stage timing
# varies by up to 0.5 us on some H200s); the tie goes to the one whose stage without a fork is fastest.
FORKED_TIE = 1.01
# A fused step whose stage is within this factor of the fastest step's is kept instead: it is the same one launch
# with or without a fork (piecewise graphs, eager calls), where an overlapped step trails its side chain, and in the
# whole decode step it measured 0.1-1.7 us faster than the overlapped step at M = 1..16 (H200, TP 8), where the
# stage alone timed the two within 0.5 % at M = 1 (benchmarks/RESULTS.md, lever table).
FUSED_TIE = 1.01
# A step other than sequential cuBLAS (the engines' own eager path) is kept only where it is at least this much
# faster than it: one process's timing of a step can read several per cent off another's, so a narrower win does not
# promise the step is never slower than the engine's own. H200, TP 4: a step timed 77.91 us in the autotuner took
# 86.18 in bench at M = 240, against sequential cuBLAS's 82.11; with a 2 % margin, steps the autotuner had timed 2.6 %
# and 2.1 % faster read 3.5 % and 6.4 % slower in bench at M = 104 and 224 (benchmarks/results/h200-tp4-fused/).
NATIVE_MARGIN = 1.05
# Then the whole decode step (kda_backend.decode_step) under the plan and under sequential cuBLAS, timed in turn in
# one process: a step is kept only where its decode step is at least this much faster. A stage timed alone follows a
# stage of the same kernels, whose drain hides its start; in the decode step other kernels run before it. H200, TP 4,
# M = 96 / 112 / 128: a fused stage timed 2.9 / 3.7 / 2.1 us faster than sequential cuBLAS's alone (1.06 / 1.08 /
# 1.04x) left the decode step 0.86 / 0.16 / 0.43 us slower (216.95 / 235.37 / 253.78 against 216.09 / 235.21 /
# 253.35, benchmarks/RESULTS.md); at TP 8 sequential cuBLAS's decode step took 1.015-1.068x the plan's at M = 1..128.
DECODE_STEP_MARGIN = 1.005
DECODE_STEP_ROUNDS = 3


def make_weight_copies(geometry: KDAGeometry, device: torch.device, copies: int = COPIES) -> list[ProjectionWeights]:
    """``copies`` independent packed weight sets (random, bf16), enough to defeat L2 across layers."""
    g = geometry
    out = []
    for _ in range(copies):
        packed = torch.randn(g.packed_rows, g.hidden_size, device=device, dtype=torch.bfloat16) * g.hidden_size**-0.5
        w_fb = torch.randn(*g.fb_shape, device=device, dtype=torch.bfloat16) * g.head_dim**-0.5
        out.append(ProjectionWeights.from_packed(packed, w_fb, g))
    return out


# The tactic-timing role of the one GEMM over the packed [QKVG; FAB] weight (a sequential step's packed form); its
# tactic is kept as QKVG's at the packed weight's rows.
PACKED = "packed"


def _role_shapes(g: KDAGeometry) -> dict[str, tuple[int, int, int]]:
    return {
        "qkvg": (g.qkvg_rows, g.hidden_size, g.hidden_size),
        PACKED: (g.packed_rows, g.hidden_size, g.hidden_size),
        "fab": (g.fab_rows, g.hidden_size, g.hidden_size),
        "fb": (g.local_width, g.head_dim, g.fab_rows),
    }


OVERLAP_CUTE = Step(overlap=True, qkvg="cute", fab="cute", fb="cute")


def _role_weight(w: ProjectionWeights, role: str) -> torch.Tensor:
    """The weight ``role``'s GEMM reads: :meth:`ProjectionWeights.of_role`, or the packed weight for :data:`PACKED`."""
    return w.packed if role == PACKED else w.of_role(role)


def time_tactic(weights: list[ProjectionWeights], role: str, tactic: AnyTactic, m: int) -> float:
    """Seconds per layer of ``role``'s GEMM alone with one CuTe tactic at ``m`` tokens, its activations with the
    real row stride (F_B reads f_a inside the wider F_A/beta output)."""
    n, k, x_row_stride = _role_shapes(weights[0].geometry)[role]
    device, c = weights[0].device, len(weights)
    x_views = [torch.randn(m, x_row_stride, device=device, dtype=torch.bfloat16)[:, :k] for _ in range(c)]
    outs = [torch.empty(m, n, device=device, dtype=torch.bfloat16) for _ in range(c)]
    w_role = [_role_weight(w, role) for w in weights]
    tactic = for_m(tactic, m)  # the token tile a wgmma tactic runs m with
    return graph_time_per_layer(lambda i: launch(tactic, x_views[i % c], w_role[i % c], outs[i % c]), layers=LAYERS)


def tactic_error(weights: list[ProjectionWeights], role: str, tactic: AnyTactic, m: int) -> str | None:
    """Why ``tactic`` must not serve ``role`` at ``m`` tokens, or ``None``: its output, poisoned with NaN before the
    launch, against the fp32 product of random activations and the first weight copy
    (:func:`~kda_backend.accuracy.output_error`). Every candidate is checked before it is timed, so a
    kernel that computes wrongly on this device is never the fastest."""
    n, k, x_row_stride = _role_shapes(weights[0].geometry)[role]
    w = _role_weight(weights[0], role)
    x = torch.randn(m, x_row_stride, device=w.device, dtype=torch.bfloat16)[:, :k]
    out = torch.full((m, n), float("nan"), device=w.device, dtype=torch.bfloat16)
    launch(for_m(tactic, m), x, w, out)
    return output_error(out, x.float() @ w.float().t())


def step_error(weights: list[ProjectionWeights], step: Step, m: int, tactics: TacticTable) -> str | None:
    """Why ``step`` must not serve ``m`` tokens, or ``None``: the stage as it is wired (its views, strides and side
    chain, beyond each kernel that :func:`tactic_error` checks), run once into output buffers poisoned with NaN
    and once allocating its outputs (the packed path, where the weights are packed), against the fp32 reference on
    random activations (:func:`~kda_backend.accuracy.output_error` for qkvg, g1 and beta). It runs eagerly: QKVG,
    then its side chain, the kernels the timed forked form runs."""
    w = weights[0]
    g = w.geometry
    proj = KDAProjection(w, Plan(steps={m: step}, source="candidate", tactics=tactics), for_tuning=True)
    if step.fused and proj.stage(m).mode != "fused":
        return "the fused stage was not taken (see its warning)"
    x = torch.randn(m, g.hidden_size, device=w.device, dtype=torch.bfloat16)
    ref = reference_projection(x, w.w_qkvg, w.w_fab, w.w_fb, g)
    buffers = [torch.full((m, cols), float("nan"), device=w.device, dtype=torch.bfloat16)
               for cols in (g.qkvg_rows, g.fab_rows, g.local_width)]
    for outs in (proj(x, *buffers), proj(x)):
        for name, out, expect in zip(("qkvg", "g1", "beta"), outs, ref):
            reason = output_error(out, expect)
            if reason is not None:
                return f"{name}: {reason}"
    return None


def verified(
    weights: list[ProjectionWeights], role: str, cands: list[AnyTactic], ms: Iterable[int],
    progress: Callable[[str], None],
) -> list[AnyTactic]:
    """The candidates whose output is right at every M of ``ms`` (:func:`tactic_error`), in order; each one dropped
    is reported."""
    kept = []
    for tactic in cands:
        reason = next((r for r in (tactic_error(weights, role, tactic, m) for m in ms) if r is not None), None)
        if reason is None:
            kept.append(tactic)
        else:
            progress(f"tactic {role} {tactic.key()} dropped: {reason}")
    return kept


def _none_right(role: str, ms: Iterable[int]) -> RuntimeError:
    return RuntimeError(f"no CuTe tactic for {role} computed right at M = {list(ms)} on this device; pin the torch "
                        "provider (KDA_BACKEND_PROVIDER=torch) and report it")


def tune_tactics(
    geometry: KDAGeometry,
    weights: list[ProjectionWeights],
    buckets: Iterable[int],
    max_candidates: int = 10,
    progress: Callable[[str], None] = lambda _: None,
) -> TacticTable:
    """The fastest CuTe tactic per (role, N, K, token bucket), in three passes:

    1. the side chain's GEMMs alone (F_B also above 64 tokens, where it follows QKVG in a sequential step);
    2. QKVG inside the overlapped stage, because a tactic that is fastest alone can hold so much shared memory
       that the side chain cannot run beside it. Each QKVG candidate is timed with the F_A/beta from pass 1 and
       with one that fits only in the slots it leaves free (:func:`spare_slot_partner`): which side chain
       overlaps best depends on QKVG's layout (measured on H200 for Kimi-K3 TP8: 16-row QKVG CTAs were fastest
       beside 12 large F_A/beta CTAs, 48-row ones beside 126 small ones, and which pair won differed between
       machines);
    3. the side chain's GEMMs again inside the stage, among neighbours of their fastest alone and the tactics
       whose CTAs fit only in the slots QKVG leaves free (:func:`~kda_backend.kernels.occupancy.spare_slot_tactics`):
       what overlaps best need not be what runs fastest alone (measured on H200 for Kimi-K3 TP8: F_A/beta with 2
       or 3 stages times the same alone, but with 3 the stage is 0.2-0.3 us faster; 12 large CTAs take twice as
       long alone as 126 small ones, but the stage is 0.5-0.8 us faster at M = 16). Finalists that tie in the
       forked stage (:data:`FORKED_TIE`) are told apart by the stage without a fork (:func:`time_trailing`), which
       eager calls and piecewise graphs run: measured on H200 for Kimi-K3 TP8 at M = 40 / 64, two F_B tactics within
       0.1 us of each other forked took 27.3 / 29.1 and 31.1 / 33.7 us there.
    """
    table: TacticTable = {}
    shapes = _role_shapes(geometry)
    capability = device_capability(weights[0].device)
    skinny = [b for b in buckets if b <= SKINNY_MAX_M]  # the side chain's kernels serve up to 64 tokens
    for role in ("fab", "fb"):
        n, k, xs = shapes[role]
        # F_B also above: a sequential step runs it after QKVG (LARGE_M_SKINNY_ROLES), so it is timed alone there.
        for bucket in buckets if role in LARGE_M_SKINNY_ROLES else skinny:
            ms = BUCKET_MS[bucket]
            cands = _shortlist(candidate_tactics(n, k, ms[-1], xs), default_tactic(n, k, ms[-1]), max_candidates)
            cands = verified(weights, role, cands, ms, progress)
            if not cands:
                raise _none_right(role, ms)
            times = {tactic: [time_tactic(weights, role, tactic, m) for m in ms] for tactic in cands}
            best = most_robust(times)
            table[(role, n, k, bucket)] = best
            progress(f"tactic {role} t{bucket}: {best.key()} ({_label_times(ms, times[best])} alone)")
    budget, (q_n, q_k, q_xs), (f_n, f_k, f_xs) = SmBudget.of(weights[0].device), shapes["qkvg"], shapes["fab"]
    for bucket in buckets:
        top = BUCKET_MS[bucket][-1]
        qkvg_key, fab_key = ("qkvg", q_n, q_k, bucket), ("fab", f_n, f_k, bucket)
        wgmma = []
        if wgmma_serves("qkvg", capability) and bucket >= WGMMA_MIN_BUCKET:
            wgmma = _wgmma_finalists(weights, "qkvg", q_n, q_k, q_xs, bucket, progress)
        if bucket > SKINNY_MAX_M:  # no CuTe side chain here: the fastest QKVG alone (none right: cuBLAS serves)
            if wgmma:
                table[qkvg_key] = wgmma[0]
                table.update(_packed_tactic(weights, bucket, progress))
            continue
        pairs = []
        q_cands, q_default = candidate_tactics(q_n, q_k, top, q_xs), default_tactic(q_n, q_k, top)
        shortlist = _shortlist(q_cands, q_default, max_candidates)
        others = [c for c in _other_row_blocks(q_cands, q_default) if c not in shortlist]
        for qkvg in verified(weights, "qkvg", shortlist + others, BUCKET_MS[bucket], progress) + wgmma:
            spare = spare_slot_tactics(f_n, f_k, top, f_xs, qkvg, qkvg.ctas(q_n, top), budget)
            extra = [t for t in [spare_slot_partner(spare)] if t not in (None, table[fab_key])]
            partners = [table[fab_key]] + verified(weights, "fab", extra, BUCKET_MS[bucket], progress)
            pairs += [{qkvg_key: qkvg, fab_key: fab} for fab in partners]
        if not pairs:
            raise _none_right("qkvg", BUCKET_MS[bucket])
        table.update(_best_in_stage(weights, bucket, table, pairs, progress))
    for role in ("fab", "fb"):
        n, k, xs = shapes[role]
        for bucket in skinny:
            top = BUCKET_MS[bucket][-1]
            cands = _neighbours(table[(role, n, k, bucket)], candidate_tactics(n, k, top, xs))
            main = table[("qkvg", q_n, q_k, bucket)]
            main_ctas = main.ctas(q_n, top)
            cands += [c for c in spare_slot_tactics(n, k, top, xs, main, main_ctas, budget) if c not in cands]
            cands = verified(weights, role, cands, BUCKET_MS[bucket], progress)
            key = (role, n, k, bucket)
            table.update(_best_in_stage(weights, bucket, table, [{key: c} for c in cands], progress,
                                        break_ties_without_fork=True))
    return table


# The smallest bucket whose QKVG candidates include the wgmma kernel: at 16 tokens and fewer mma.sync streams at
# 96-99 % of copy bandwidth on H200.
WGMMA_MIN_BUCKET = 32


def wgmma_shortlist(n: int, k: int, m: int, x_row_stride: int) -> list[AnyTactic]:
    """The wgmma QKVG candidates timed alone: the default (64-row CTAs, the deepest one-CTA ring), the deepest
    one-CTA rings of 128-row CTAs and of 128-element K-tiles, each with and without programmatic dependent launch
    (measured on H200 for Kimi-K3 TP8 at M = 32: 64-row CTAs 23.03 us without it and 24.18 with it, 128-row ones
    24.50 and 27.86; at TP4 64-row CTAs were faster with it), the tokens-on-M tactics
    (:func:`~kda_backend.kernels.wgmma_gemm.tokens_on_m_tactics`), the swap-AB one of fewer rows than an atom
    (:func:`~kda_backend.kernels.wgmma_gemm.padded_rows_tactics`) and the token tiles sharing weights in clusters
    (:func:`~kda_backend.kernels.wgmma_gemm.weight_cluster_tactics`), at most :data:`WGMMA_CANDIDATES`."""
    default = default_wgmma_tactic(n, k, m)
    cands = wgmma_candidate_tactics(n, k, m, x_row_stride)

    def deepest(block_n: int, block_k: int) -> list[AnyTactic]:
        same = [c for c in cands if (c.block_n, c.block_k, c.split_k) == (block_n, block_k, 1)]
        return [max(same, key=lambda c: c.stages)] if same else []

    picks = [default, dataclasses.replace(default, pdl=False)]
    for tactic in deepest(128, 64):
        picks += [dataclasses.replace(tactic, pdl=False), tactic]
    picks += deepest(64, 128)
    picks += [c for c in cands if c.tokens_on_m or c.padded_rows]  # weight clusters run tokens on M too
    return list(dict.fromkeys(picks))[:WGMMA_CANDIDATES]


def _wgmma_finalists(
    weights, role: str, n: int, k: int, xs: int, bucket: int, progress: Callable[[str], None]
) -> list:
    """The :data:`WGMMA_FINALISTS` fastest wgmma tactics for ``role`` (QKVG, or :data:`PACKED`) alone over the
    bucket's M, fastest first (none where none computes right), and the fastest one that
    :func:`~kda_backend.kernels.wgmma_gemm.leaves_room` for the side chain. A deep ring over every
    SM wins alone and loses in the stage: measured on H200 for Kimi-K3 TP 8, 128 tokens-on-M CTAs of 48 rows with
    12 stages took QKVG alone 1.000-1.048x its floor at M = 17..64, but the stage 2.6-19.6 us longer than QKVG alone,
    with 8 stages 0.4-5.6 us (`benchmarks/results/levers/wgmma-tokens-on-m.log`)."""
    ms = BUCKET_MS[bucket]
    shortlist = verified(weights, role, wgmma_shortlist(n, k, ms[-1], xs), ms, progress)
    if not shortlist:
        return []
    times = {tactic: [time_tactic(weights, role, tactic, m) for m in ms] for tactic in shortlist}
    slowdown = worst_slowdowns(times)
    ranked = sorted(times, key=lambda tactic: slowdown[tactic])
    timed = "; ".join(f"{t.key()} {_label_times(ms, times[t])}" for t in ranked)
    progress(f"tactic {role} t{bucket} wgmma: {timed}")
    finalists = ranked[:WGMMA_FINALISTS]
    roomy = [tactic for tactic in ranked if leaves_room(tactic)]
    return finalists + [roomy[0]] if roomy and roomy[0] not in finalists else finalists


def _packed_tactic(weights: list[ProjectionWeights], bucket: int, progress: Callable[[str], None]) -> TacticTable:
    """Where the weights are packed (vLLM's layout), the fastest wgmma tactic alone over the bucket's M for one GEMM
    over the packed ``[QKVG; FAB]`` weight, kept as QKVG's tactic at the packed rows: a sequential step whose QKVG
    provider serves it then runs that one GEMM and F_B after it (:meth:`~kda_backend.projection.KDAProjection.stage`).
    Measured on H200 for Kimi-K3 TP 8 (131 swap-AB CTAs of 48 rows over the 6288 rows), F_B on the mma.sync kernel
    after it: the step 27.17 / 27.74 / 28.49 us at M = 104 / 112 / 120 against sequential cuBLAS's 29.31 / 29.31 /
    29.89 (benchmarks/results/h200-large-m/tp8/)."""
    if weights[0].packed is None:
        return {}
    n, k, xs = _role_shapes(weights[0].geometry)[PACKED]
    finalists = _wgmma_finalists(weights, PACKED, n, k, xs, bucket, progress)
    return {("qkvg", n, k, bucket): finalists[0]} if finalists else {}


def device_capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def spare_slot_partner(spare: list[Tactic]) -> Tactic | None:
    """Of the spare-slot tactics for F_A/beta beside one QKVG tactic, the one QKVG is first timed with: the deepest
    ring with activations from L2 (measured on H200 beside 16-row QKVG CTAs: 4 stages beat 2 and 3; the three
    activation paths were within 0.2 us of each other at M = 1 and 8, and at M = 16 the L1 path lost 0.4 us)."""
    plain = [t for t in spare if t == t.with_activations_from_l2()]
    return max(plain, key=lambda t: t.stages, default=None)


def _best_in_stage(
    weights: list[ProjectionWeights], bucket: int, table: TacticTable, candidates: list[TacticTable],
    progress: Callable[[str], None], break_ties_without_fork: bool = False,
) -> TacticTable:
    """The candidate (tactics for one or more GEMMs) that makes the overlapped all-CuTe stage fastest over the
    bucket's M (the other GEMMs keep their tactics in ``table``); returns it. Every candidate is timed
    once at each M; the ``FINALISTS`` most robust are timed ``RETIMING_ROUNDS`` more times, in turn, and judged by
    their medians: one stage timing varies by up to 0.5 us on some H200s, more than the gaps between the best
    candidates. With ``break_ties_without_fork``, finalists that tie with the best go through
    :func:`_fastest_without_fork`."""
    ms = BUCKET_MS[bucket]
    frozen = [tuple(c.items()) for c in candidates]  # hashable, in the caller's order

    def timed(candidate: tuple) -> list[float]:
        return [time_step(weights, OVERLAP_CUTE, m, {**table, **dict(candidate)}) for m in ms]

    rounds = {candidate: [timed(candidate)] for candidate in frozen}
    slowdown = worst_slowdowns({candidate: times[0] for candidate, times in rounds.items()})
    finalists = sorted(frozen, key=slowdown.__getitem__)[:FINALISTS]
    if len(finalists) > 1:
        for _ in range(RETIMING_ROUNDS):
            for candidate in finalists:
                rounds[candidate].append(timed(candidate))
    medians = {c: [statistics.median(column) for column in zip(*rounds[c])] for c in finalists}
    best = most_robust(medians)
    others = "; ".join(f"{_candidate_label(c)} {_label_times(ms, medians[c])}" for c in finalists if c != best)
    progress(f"t{bucket} stage: {_candidate_label(best)} ({_label_times(ms, medians[best])} overlapped stage"
             f"{', over ' + others if others else ''})")
    if break_ties_without_fork:
        tied = [c for c in finalists if all(t <= FORKED_TIE * b for t, b in zip(medians[c], medians[best]))]
        best = _fastest_without_fork(weights, bucket, table, tied, best, progress)
    return dict(best)


def _fastest_without_fork(
    weights: list[ProjectionWeights], bucket: int, table: TacticTable, tied: list[tuple], best: tuple,
    progress: Callable[[str], None],
) -> tuple:
    """Of candidates whose forked stages tie, the one whose stage without a fork (:func:`time_trailing`) is most
    robust over the bucket's M; ``best`` where fewer than two tie, where the provider builds no such form, or where
    timing it fails (reported: the forked choice stands)."""
    if len(tied) < 2:
        return best
    ms = BUCKET_MS[bucket]
    try:
        times = {c: [time_trailing(weights, m, {**table, **dict(c)}) for m in ms] for c in tied}
    except Exception as exc:  # the forked choice is sound; a form that cannot be timed must not stop tuning
        progress(f"t{bucket} stage without a fork not timed ({type(exc).__name__}: {exc}); keeping "
                 f"{_candidate_label(best)}")
        return best
    if any(None in row for row in times.values()):
        return best
    chosen = most_robust(times)
    labels = "; ".join(f"{_candidate_label(c)} {_label_times(ms, times[c])}" for c in tied)
    progress(f"t{bucket} stage without a fork, among the tied: {_candidate_label(chosen)} ({labels})")
    return chosen


def _candidate_label(candidate: tuple) -> str:
    return " + ".join(f"{key[0]} {tactic.key()}" for key, tactic in candidate)


def most_robust(times: dict[Hashable, list[float]]) -> Hashable:
    """The candidate whose worst slowdown against the fastest candidate at each timed M is smallest (the first
    listed wins a tie). A sum over M can pick a tactic that loses at the bucket's largest M, where the stage is
    furthest from its floor: on H200 the sum picked QKVG with activations from L2, whose stage was 0.5-0.8 us
    slower at M = 13..16 (benchmarks/RESULTS.md, levers)."""
    return min(times, key=worst_slowdowns(times).__getitem__)


def worst_slowdowns(times: dict[Hashable, list[float]]) -> dict[Hashable, float]:
    """Each candidate's largest ratio to the fastest candidate at any timed M."""
    fastest = [min(column) for column in zip(*times.values())]
    return {tactic: max(t / f for t, f in zip(row, fastest)) for tactic, row in times.items()}


def _label_times(ms: tuple[int, ...], seconds: list[float]) -> str:
    return ", ".join(f"M={m} {t * 1e6:.2f} us" for m, t in zip(ms, seconds))


def _neighbours(tactic: Tactic, cands: list[Tactic]) -> list[Tactic]:
    """``tactic`` first, then the candidates that differ from it only by one stage more or fewer or by the
    activation path (through L1 or not): the side chain's shared memory and load pattern, which decide how it
    overlaps."""
    same_shape = [
        c for c in cands
        if c != tactic and (c.block_n, c.block_k, c.block_t, c.split_k, c.x_tma, c.pdl)
        == (tactic.block_n, tactic.block_k, tactic.block_t, tactic.split_k, tactic.x_tma, tactic.pdl)
        and abs(c.stages - tactic.stages) <= 1
    ]
    return [tactic, *same_shape]


def _shortlist(cands: list[Tactic], default: Tactic, limit: int) -> list[Tactic]:
    """The default first, then candidates closest to it (same block_n first), at most ``limit``."""
    others = [c for c in cands if c != default]
    others.sort(
        key=lambda c: (c.block_n != default.block_n, abs(c.stages - default.stages), c.block_k != default.block_k)
    )
    return [default, *others[: limit - 1]]


def _other_row_blocks(cands: list[Tactic], default: Tactic) -> list[Tactic]:
    """The candidates with the default's K-tile, ring depth and split but other rows per CTA, by every activation
    path but TMA (which starves the side chain, see :attr:`Tactic.x_tma`): the shortlist holds the default's CTA
    height only, and measured on H200 for Kimi-K3 TP8 QKVG, 48-row CTAs (one per SM) were 0.3-0.4 us faster alone
    than 16-row ones at M = 1..16."""
    return [
        c for c in cands
        if c.block_n != default.block_n and not c.x_tma
        and (c.block_k, c.block_t, c.stages, c.split_k, c.pdl) == (default.block_k, default.block_t, default.stages,
                                                                    default.split_k, default.pdl)
    ]


def usable_providers(
    weights: ProjectionWeights, m: int, tactics: TacticTable | None = None
) -> dict[str, tuple[str, ...]]:
    """Per role, the names of the providers that can serve this device's GEMM at ``m`` tokens with the CuTe
    ``tactics`` (some kernels serve an M only with a tactic tuned for it), best first."""
    projection = KDAProjection(weights, Plan(tactics=tactics or {}))
    usable = {}
    for role in ROLES:
        call = projection.gemm_call(role, m)
        usable[role] = tuple(
            p.name for p in hooks.gemm_providers()
            if dispatch.broken_reason(p.name) is None and dispatch.why_not(p, call) is None
        )
    return usable


def fusing_providers(weights: ProjectionWeights, m: int, tactics: TacticTable | None = None) -> tuple[str, ...]:
    """The names of the providers that run this device's whole stage at ``m`` tokens as one fused launch
    (:meth:`~kda_backend.providers.base.GemmProvider.why_not_fused`)."""
    projection = KDAProjection(weights, Plan(tactics=tactics or {}))
    calls = {role: projection.gemm_call(role, m) for role in ROLES}
    names = []
    for provider in hooks.gemm_providers():
        try:
            if dispatch.broken_reason(provider.name) is None and provider.why_not_fused(calls) is None:
                names.append(provider.name)
        except Exception:  # a plugin's provider may fail in any way; it then fuses nothing here
            continue
    return tuple(names)


def step_candidates(usable: dict[str, tuple[str, ...]], fusing: tuple[str, ...] = ()) -> list[Step]:
    """Overlapped or sequential x provider of QKVG x provider of the side chain. F_B follows the side chain's
    provider where that one serves it (it reads a strided view not every provider takes), else ``auto``; a
    provider that serves F_B but not F_A/beta (CuTe above 64 tokens) gets F_B beside each F_A/beta provider too. Then
    a fused step for each provider in ``fusing`` (overlapped where its fused stage is not taken)."""
    fb_only = [name for name in usable["fb"] if name not in usable["fab"]]
    return [
        Step(overlap=overlap, qkvg=main, fab=side, fb=fb)
        for overlap, main, side in itertools.product((False, True), usable["qkvg"], usable["fab"])
        for fb in [side if side in usable["fb"] else AUTO, *fb_only]
    ] + [Step(overlap=True, fused=True, qkvg=name, fab=name, fb=name) for name in fusing]


def time_step(weights: list[ProjectionWeights], step: Step, m: int, tactics: TacticTable) -> float:
    """Seconds per layer of the whole projection stage with ``step`` and CuTe ``tactics`` at ``m`` tokens (an
    overlapped step forked inside the timing graph)."""
    device = weights[0].device
    plan = Plan(steps={m: step}, source="candidate", tactics=tactics)
    projs = [KDAProjection(w, plan, for_tuning=True) for w in weights]
    for p in projs:
        p.prepare([m])
    g = weights[0].geometry
    xs = [torch.randn(m, g.hidden_size, device=device, dtype=torch.bfloat16) for _ in weights]
    return graph_time_per_layer(lambda i: projs[i % len(projs)](xs[i % len(xs)]), layers=LAYERS)


def time_trailing(weights: list[ProjectionWeights], m: int, tactics: TacticTable) -> float | None:
    """Seconds per layer of the overlapped all-CuTe stage with CuTe ``tactics`` at ``m`` tokens without a fork:
    QKVG's launch, then the side chain trailing it on the same stream, as piecewise graphs (and eager calls above
    the one-launch stage's M) run it; ``None`` where the provider builds no such form for these tactics."""
    device, g = weights[0].device, weights[0].geometry
    plan = Plan(steps={m: OVERLAP_CUTE}, source="candidate", tactics=tactics)
    stages = [KDAProjection(w, plan).stage(m) for w in weights]
    if any(stage.trail is None for stage in stages):
        return None
    operands = [
        (torch.randn(m, g.hidden_size, device=device, dtype=torch.bfloat16),
         *(torch.empty(m, cols, device=device, dtype=torch.bfloat16)
           for cols in (g.qkvg_rows, g.fab_rows, g.local_width)))
        for _ in weights
    ]

    def layer(i: int) -> None:
        j = i % len(weights)
        stage, w, (x, qkvg, fab, g1) = stages[j], weights[j], operands[j]
        stage.qkvg(x, w.w_qkvg, qkvg)
        stage.trail(x, w.w_fab, fab, w.w_fb, g1)

    return graph_time_per_layer(layer, layers=LAYERS)


def tune_plan(
    weights: list[ProjectionWeights],
    ms: Iterable[int] = DEFAULT_MS,
    progress: Callable[[str], None] = lambda _: None,
    tactics: TacticTable | None = None,
) -> tuple[Plan, dict[int, dict[str, float]]]:
    """Per M, the fastest step with CuTe ``tactics`` (which the plan keeps) among those that compute right
    (:func:`step_error`), a fused one where it ties with the fastest (:data:`FUSED_TIE`), where it beats sequential
    cuBLAS by :data:`NATIVE_MARGIN`, else sequential cuBLAS; also returns every candidate's time (seconds per layer)
    for reports."""
    tactics = tactics or {}
    steps: dict[int, Step] = {}
    timings: dict[int, dict[str, float]] = {}
    for m in ms:
        results = []
        usable = usable_providers(weights[0], m, tactics)
        for step in step_candidates(usable, fusing_providers(weights[0], m, tactics)):
            try:
                reason = step_error(weights, step, m, tactics)
                if reason is not None:
                    progress(f"M={m} {_step_label(step)} dropped: {reason}")
                    continue
                results.append((time_step(weights, step, m, tactics), step))
            except Exception as exc:  # a candidate that cannot run is not a plan; report it and go on
                progress(f"M={m} {step} failed: {type(exc).__name__}: {exc}")
        if not results:
            raise RuntimeError(f"no projection step computed right at M={m} on this device, sequential cuBLAS "
                               "included; the device or its libraries are at fault")
        kept, tie = _fused_wins_a_tie(results)
        best_time, best, note = _keep_native_unless_clearly_beaten(kept)
        note = tie + note if best.fused else note
        steps[m] = best
        timings[m] = {_step_label(s): t for t, s in results}
        progress(f"M={m}: {_step_label(best)} {best_time * 1e6:.2f} us{note}")
    return Plan(steps=steps, source="autotune", fallback=SEQUENTIAL_TORCH, tactics=tactics), timings


def _fused_wins_a_tie(results: list[tuple[float, Step]]) -> tuple[list[tuple[float, Step]], str]:
    """``(results, note)``: ``results`` without the steps faster than the fastest fused step where that one is within
    :data:`FUSED_TIE` of the fastest step (sequential cuBLAS stays, for the margin it is weighed by) and clears that
    margin itself (else the tie would hand the choice to sequential cuBLAS, which the fastest step beat), and a note
    naming the fastest step it beat on the tie."""
    fastest_time, fastest = min(results, key=lambda r: r[0])
    fused = min(((t, s) for t, s in results if s.fused), key=lambda r: r[0], default=None)
    native = next((t for t, s in results if s == SEQUENTIAL_TORCH), None)
    if fused is None or fused[1] == fastest or fused[0] > FUSED_TIE * fastest_time:
        return results, ""
    if native is not None and fused[0] * NATIVE_MARGIN > native:
        return results, ""
    kept = [(t, s) for t, s in results if t >= fused[0] or s == SEQUENTIAL_TORCH]
    return kept, f" (fused wins the tie with {_step_label(fastest)} {fastest_time * 1e6:.2f} us)"


def _keep_native_unless_clearly_beaten(results: list[tuple[float, Step]]) -> tuple[float, Step, str]:
    """``(seconds, step, note)``: the fastest step, or sequential cuBLAS where it was timed and the fastest is not
    :data:`NATIVE_MARGIN` times faster; the note names what the choice was weighed against, for the progress line."""
    fastest_time, fastest = min(results, key=lambda r: r[0])
    native = next((t for t, step in results if step == SEQUENTIAL_TORCH), None)
    if native is None or fastest == SEQUENTIAL_TORCH:
        return fastest_time, fastest, ""
    if fastest_time * NATIVE_MARGIN > native:
        return native, SEQUENTIAL_TORCH, (f" (fastest {_step_label(fastest)} {fastest_time * 1e6:.2f} us, "
                                          f"within {NATIVE_MARGIN}x)")
    return fastest_time, fastest, f" (sequential cuBLAS {native * 1e6:.2f} us)"


MODE_LABELS = {"fused": "fused", "overlap": "ovl", "sequential": "seq"}


def _step_label(step: Step) -> str:
    fb = "" if step.fb in (step.fab, AUTO) else f"/{step.fb}"
    return f"{MODE_LABELS[step.mode]}:{step.qkvg}/{step.fab}{fb}"


def autotune(
    geometry: KDAGeometry,
    device: torch.device,
    ms: Iterable[int] = DEFAULT_MS,
    progress: Callable[[str], None] = lambda _: None,
) -> Plan:
    """Tune tactics then the plan (which keeps them) for ``geometry`` on ``device``."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("autotune cannot run inside a CUDA-graph capture")
    ms = sorted(set(ms))
    weights = make_weight_copies(geometry, device)
    top = max_m("qkvg", device_capability(device))
    buckets = sorted({tactic_bucket(m) for m in ms if m <= top})
    tactics = tune_tactics(geometry, weights, buckets, progress=progress)
    plan, _ = tune_plan(weights, ms, progress=progress, tactics=tactics)
    del weights  # the decode step's layers bring their own weights
    try:
        return confirm_in_decode_step(plan, DecodeStepTimer(geometry, device), progress)
    except Exception as exc:  # e.g. fla-core missing: the stage's choice stands, unconfirmed
        warn_once("decode-step-check", f"autotune: the decode step did not run ({type(exc).__name__}: {exc}); the "
                  "plan keeps the steps chosen by the projection stage's time alone")
        progress(f"decode step not timed: {type(exc).__name__}: {exc}")
        return plan


def confirm_in_decode_step(
    plan: Plan, timer: DecodeStepTimer, progress: Callable[[str], None] = lambda _: None
) -> Plan:
    """``plan`` with each tuned step other than sequential cuBLAS kept only where the whole decode step under it is
    :data:`DECODE_STEP_MARGIN` times faster than under sequential cuBLAS (medians of :data:`DECODE_STEP_ROUNDS`
    rounds, the two timed in turn), else sequential cuBLAS."""
    steps = dict(plan.steps)
    for m, step in sorted(plan.steps.items()):
        if step == SEQUENTIAL_TORCH:
            continue
        times = timer.times({"plan": plan, "seq": SEQUENTIAL_CUBLAS}, m, DECODE_STEP_ROUNDS)
        ours, seq = statistics.median(times["plan"]), statistics.median(times["seq"])
        kept = ours * DECODE_STEP_MARGIN <= seq
        if not kept:
            steps[m] = SEQUENTIAL_TORCH
        verdict = "kept" if kept else f"sequential cuBLAS instead (within {DECODE_STEP_MARGIN}x)"
        progress(f"M={m} decode step: {_step_label(step)} {ours:.2f} us, sequential cuBLAS {seq:.2f} us: {verdict}")
    return dataclasses.replace(plan, steps=steps)
