"""``kda-backend bench``: the projection stage against its baselines and the HBM floor, in one run on one GPU.

Variants per M (all through :class:`~kda_backend.projection.KDAProjection`, inside CUDA graphs of many layers
with rotated weights, see :mod:`kda_backend.timing`):

- ``seq_cublas``: sequential, one cuBLAS GEMM over the packed [QKVG; FAB] weight then F_B (vLLM's fallback path);
- ``peers``: cuBLAS QKVG on the main stream, cuBLAS F_A/beta -> F_B on an aux stream (both engines' Hopper design);
- ``ours``: this device's tuned plan (or whatever :func:`~kda_backend.planning.resolve_plan` gives);
- ``vllm_native`` / ``sglang_native``: each engine's own decision at that M on this GPU (:mod:`kda_backend.native`);
- ``qkvg_cublas`` / ``qkvg_cute`` / ``fab_cute`` / ``fb_cute``: single GEMMs alone, for the kernel report (which
  also names the CuTe tactics, so a run records what the tuner chose);
- the whole ``KimiK3DeltaAttention`` decode step at :data:`LAYER_MS` under ours and under ``seq_cublas``, alternated:
  what a stage's gain leaves in the layer.

The floor at each M is the longer of weight bytes / copy bandwidth and the stage's FLOPs / the dense bf16 rate of a
large square ``torch.mm``, both measured in the same run. By default every batch size either engine
captures in CUDA graphs is measured (:mod:`kda_backend.batch_sizes`).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kda_backend import native
from kda_backend.autotune import MODE_LABELS, make_weight_copies
from kda_backend.batch_sizes import engine_batch_sizes, spans
from kda_backend.decode_step import DecodeStepTimer
from kda_backend.geometry import KDAGeometry
from kda_backend.kernels.skinny_gemm import Tactic
from kda_backend.kernels.wgmma_stage import fused_stage_tactic
from kda_backend.plan import SEQUENTIAL_CUBLAS, SEQUENTIAL_TORCH, Plan, Step
from kda_backend.planning import resolve_plan
from kda_backend.projection import KDAProjection
from kda_backend.providers.cute_provider import launch
from kda_backend.timing import (
    LAYERS,
    copy_bandwidth,
    dense_bf16_rate,
    eager_time_per_call,
    graph_time_per_layer,
    require_cuda,
)
from kda_backend.weights import ProjectionWeights

# Every batch size either engine captures by default, up to the largest M plans are tuned for.
DEFAULT_MS = engine_batch_sizes("all")
# M at which the single GEMMs are also timed alone (the kernel table): the CuTe kernels' range.
KERNEL_MS = (*range(1, 17), 24, 32, 48, 64, 96, 128, 192, 256)
# M at which eager calls (no graph: an engine's eager mode) are timed too.
EAGER_MS = tuple(range(1, 17))
LAYER_MS = (1, 4, 16, 64, 128)
# The stage variants are timed in alternation, this many rounds, and each reports its median, so the ratios compare
# columns measured under the same clocks. Where ours runs the very same path as a baseline (sequential packed
# cuBLAS at M >= 128), one round apiece measured ratios from 0.94 to 1.02 between runs.
STAGE_ROUNDS = 3
PEERS = Step(overlap=True, qkvg="torch", fab="torch", fb="torch")


def _stage_time(weights, plan: Plan, m: int) -> float:
    projs = [KDAProjection(w, plan) for w in weights]
    for p in projs:
        p.prepare([m])
    g = weights[0].geometry
    xs = [torch.randn(m, g.hidden_size, device=weights[0].device, dtype=torch.bfloat16) for _ in weights]
    return graph_time_per_layer(lambda i: projs[i % len(projs)](xs[i % len(xs)]), layers=LAYERS)


def _eager_times(weights, plan: Plan, m: int) -> tuple[float, float]:
    """Eager seconds per call and host seconds per call of the stage (layers rotating over the weight copies)."""
    projs = [KDAProjection(w, plan) for w in weights]
    for p in projs:
        p.prepare([m])
    g = weights[0].geometry
    xs = [torch.randn(m, g.hidden_size, device=weights[0].device, dtype=torch.bfloat16) for _ in weights]
    return eager_time_per_call(lambda i: projs[i % len(projs)](xs[i % len(xs)]))


def _gemm_time(weights, role: str, m: int, provider: str, plan: Plan) -> tuple[float, Tactic | None, int | None]:
    """Seconds per call of one role's GEMM alone, and the CuTe kernel's tactic (``plan``'s) and CTA count."""
    from kda_backend import dispatch

    g = weights[0].geometry
    device = weights[0].device
    n, k = weights[0].of_role(role).shape
    xs_stride = g.fab_rows if role == "fb" else g.hidden_size
    xs = [torch.randn(m, xs_stride, device=device, dtype=torch.bfloat16)[:, :k] for _ in weights]
    outs = [torch.empty(m, n, device=device, dtype=torch.bfloat16) for _ in weights]
    tactic, ctas = None, None
    if provider == "cute":
        cute = dispatch.provider_by_name("cute")
        proj = KDAProjection(weights[0], plan)
        tactic = cute.tactic(proj.gemm_call(role, m))
        ctas = tactic.ctas(n, m)

        def run(i: int) -> None:
            launch(tactic, xs[i % len(xs)], weights[i % len(weights)].of_role(role), outs[i % len(outs)])
    else:

        def run(i: int) -> None:
            torch.mm(xs[i % len(xs)], weights[i % len(weights)].of_role(role).t(), out=outs[i % len(outs)])

    return graph_time_per_layer(run, layers=LAYERS), tactic, ctas


def run_bench(
    geometry: KDAGeometry,
    ms: tuple[int, ...] = DEFAULT_MS,
    tick: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Measure every variant for every M; returns JSON-compatible results (times in microseconds)."""
    device = require_cuda()
    bandwidth = copy_bandwidth()
    flop_rate = dense_bf16_rate()
    weights = make_weight_copies(geometry, device)
    plan = resolve_plan(geometry, device, batch_sizes=ms)
    hbm_floor_us = geometry.weight_bytes() / bandwidth * 1e6
    qkvg_floor_us = geometry.qkvg_rows * geometry.hidden_size * 2 / bandwidth * 1e6
    capability = torch.cuda.get_device_capability(device)
    split = [ProjectionWeights.from_split(w.w_qkvg, w.w_fab, w.w_fb, w.geometry) for w in weights]
    rows = []
    for m in ms:
        floor_us = max(hbm_floor_us, geometry.stage_flops(m) / flop_rate * 1e6)
        row: dict[str, Any] = {"m": m, "floor": floor_us, "qkvg_floor": qkvg_floor_us, "plan": plan.step(m).to_json()}
        variants = {
            "seq_cublas": (SEQUENTIAL_TORCH, weights),
            "peers": (PEERS, weights),
            "ours": (plan.step(m), weights),
            "vllm_native": (native.vllm_step(geometry, m, capability), weights),
            "sglang_native": (native.sglang_step(m, capability), split),
        }
        # Variants that run the very same stage are timed once (the layout matters only to sequential cuBLAS,
        # which is one GEMM over packed weights and two over split ones).
        same: dict[tuple, str] = {}
        for name, (step, ws) in variants.items():
            same.setdefault((step, ws is split and step == SEQUENTIAL_TORCH), name)
        samples: dict[str, list[float]] = {name: [] for name in same.values()}
        for _ in range(STAGE_ROUNDS):
            for name in samples:
                step, ws = variants[name]
                # Every variant runs the plan's CuTe tactics: variants differ only in their steps.
                variant = plan if name == "ours" else Plan(fallback=step, source=name, tactics=plan.tactics)
                samples[name].append(_stage_time(ws, variant, m) * 1e6)
        for name, (step, ws) in variants.items():
            row[name] = statistics.median(samples[same[(step, ws is split and step == SEQUENTIAL_TORCH)]])
        row["vllm_step"] = variants["vllm_native"][0].to_json()
        row["sglang_step"] = variants["sglang_native"][0].to_json()
        step = plan.step(m)
        # The CuTe provider's fused stage derives its QKVG tactic from M (another provider's has its own).
        fused = fused_stage_tactic(geometry.qkvg_rows, geometry.hidden_size, m) if step.fused else None
        if fused is not None and step.qkvg == "cute":
            row["fused_qkvg_tactic"] = fused.key()
        if m in EAGER_MS:
            for name, variant in (("ours", plan), ("seq_cublas", SEQUENTIAL_CUBLAS)):
                wall, host = _eager_times(weights, variant, m)
                row[f"eager_{name}"], row[f"host_{name}"] = wall * 1e6, host * 1e6
        if m in KERNEL_MS:
            row["qkvg_cublas"] = _gemm_time(weights, "qkvg", m, "torch", plan)[0] * 1e6
            for role in ("qkvg", "fab", "fb"):
                t, tactic, ctas = _gemm_time(weights, role, m, "cute", plan)
                row[f"{role}_cute"], row[f"{role}_tactic"], row[f"{role}_ctas"] = t * 1e6, tactic.key(), ctas
        rows.append(row)
        tick()
    layer_rows = []
    decode_steps = DecodeStepTimer(geometry, device) if any(m in ms for m in LAYER_MS) else None
    for m in LAYER_MS:
        if m not in ms:
            continue
        # The decode step under sequential cuBLAS too, alternated with ours: a stage timed between stages of the
        # same kernels need not show what the layer gains (H200, TP 8: 48-63 % of it at M = 1..16 in the decode
        # step, benchmarks/RESULTS.md).
        variants = {"ours": plan}
        if plan.step(m) != SEQUENTIAL_TORCH:
            variants["seq_cublas"] = SEQUENTIAL_CUBLAS
        times = decode_steps.times(variants, m, STAGE_ROUNDS)
        layer_us = statistics.median(times["ours"])
        seq_us = statistics.median(times.get("seq_cublas", times["ours"]))
        ours = next(r["ours"] for r in rows if r["m"] == m)
        layer_rows.append({"m": m, "layer": layer_us, "layer_seq_cublas": seq_us, "projection": ours,
                           "share": ours / layer_us})
    return {
        "device": torch.cuda.get_device_name(device),
        "capability": list(torch.cuda.get_device_capability(device)),
        "torch": torch.__version__,
        "geometry": geometry.describe(),
        "copy_bandwidth_tbs": bandwidth / 1e12,
        "dense_bf16_tflops": flop_rate / 1e12,
        "hbm_floor_us": hbm_floor_us,
        "weight_bytes": geometry.weight_bytes(),
        "plan_source": plan.source,
        "plan": plan.describe(),
        "rows": rows,
        "layer_rows": layer_rows,
    }


def render_table(results: dict[str, Any]) -> str:
    """The stage table (times in us, ratios) and the kernel table."""
    lines = [
        f"{results['device']}  copy bandwidth {results['copy_bandwidth_tbs']:.3f} TB/s  "
        f"dense bf16 {results.get('dense_bf16_tflops', float('nan')):.0f} TFLOP/s  "
        f"HBM floor {results.get('hbm_floor_us', results['rows'][0]['floor']):.2f} us  plan: {results['plan_source']}",
        f"{'M':>4} {'seq_cuBLAS':>10} {'peers':>8} {'vllm':>8} {'sglang':>8} {'ours':>8} {'floor':>7} "
        f"{'ours/floor':>10} {'seq/ours':>8} {'ours/native':>11}  plan",
    ]
    for r in results["rows"]:
        step = Step.from_json(r["plan"])
        mode = f"{MODE_LABELS[step.mode]} {step.qkvg}/{step.fab}/{step.fb}"
        natives = [r[k] for k in ("vllm_native", "sglang_native") if k in r]
        cells = [f"{r[k]:>8.2f}" if k in r else f"{'-':>8}" for k in ("vllm_native", "sglang_native")]
        ratio = f"{r['ours'] / min(natives):>11.3f}" if natives else f"{'-':>11}"
        lines.append(
            f"{r['m']:>4} {r['seq_cublas']:>10.2f} {r['peers']:>8.2f} {' '.join(cells)} {r['ours']:>8.2f} "
            f"{r['floor']:>7.2f} {r['ours'] / r['floor']:>10.3f} {r['seq_cublas'] / r['ours']:>8.3f} {ratio}  {mode}"
        )
    lines.append("ours/native: ours over the faster of vllm_native and sglang_native (below 1: ours is faster)")
    if "vllm_native" in results["rows"][0]:
        lines.append(native.describe())
    same = [r["m"] for r in results["rows"] if Step.from_json(r["plan"]) == SEQUENTIAL_TORCH]
    if same:
        lines.append(f"M = {spans(same)}: ours runs seq_cuBLAS's own step (one timing serves both)")
    lines.append("")
    lines.append(
        f"{'M':>4} {'qkvg_cute':>9} {'%copyBW':>8} {'qkvg_cuBLAS':>11} {'cuBLAS/cute':>11} "
        f"{'fab_cute':>8} {'fab_CTAs':>8} {'fb_cute':>7} {'fb_CTAs':>7}"
    )
    for r in results["rows"]:
        if "qkvg_cute" not in r:
            continue
        lines.append(
            f"{r['m']:>4} {r['qkvg_cute']:>9.2f} {r['qkvg_floor'] / r['qkvg_cute'] * 100:>7.1f}% "
            f"{r['qkvg_cublas']:>11.2f} {r['qkvg_cublas'] / r['qkvg_cute']:>11.3f} "
            f"{r['fab_cute']:>8.2f} {r['fab_ctas']:>8} {r['fb_cute']:>7.2f} {r['fb_ctas']:>7}"
        )
    lines += _tactic_lines(results["rows"])
    eager = [r for r in results["rows"] if "eager_ours" in r]
    if eager:
        lines += ["", "eager calls (no graph; us per call, host = time to issue one call)",
                  f"{'M':>4} {'ours':>8} {'seq_cuBLAS':>10} {'ours/seq':>8} {'host ours':>9} {'host seq':>8}"]
        for r in eager:
            lines.append(f"{r['m']:>4} {r['eager_ours']:>8.2f} {r['eager_seq_cublas']:>10.2f} "
                         f"{r['eager_ours'] / r['eager_seq_cublas']:>8.3f} {r['host_ours']:>9.2f} "
                         f"{r['host_seq_cublas']:>8.2f}")
    if results.get("layer_rows"):
        lines += ["", "KDA decode step (the whole layer; us per layer, projection = ours in the stage table)",
                  f"{'M':>4} {'ours':>8} {'seq_cuBLAS':>10} {'seq/ours':>8} {'projection':>10} {'share':>6}"]
        for r in results["layer_rows"]:
            seq = r.get("layer_seq_cublas")  # results written before the bench timed it have none
            cells = f"{seq:>10.2f} {seq / r['layer']:>8.3f}" if seq is not None else f"{'-':>10} {'-':>8}"
            lines.append(f"{r['m']:>4} {r['layer']:>8.2f} {cells} {r['projection']:>10.2f} {r['share'] * 100:>5.1f}%")
    return "\n".join(lines)


def _tactic_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The CuTe tactics the kernel table timed, one line per tactic triple with the M it served (results written
    before the bench recorded tactics have none), then the fused stage's QKVG tactic where the plan fuses."""
    served: dict[str, list[int]] = {}
    for r in rows:
        if "qkvg_tactic" in r:
            served.setdefault(" / ".join(r[f"{role}_tactic"] for role in ("qkvg", "fab", "fb")), []).append(r["m"])
    fused: dict[str, list[int]] = {}
    for r in rows:
        if "fused_qkvg_tactic" in r:
            fused.setdefault(r["fused_qkvg_tactic"], []).append(r["m"])
    lines = []
    if served:
        lines += ["CuTe tactics (qkvg / fab / fb):"] + [f"  M = {spans(ms)}: {keys}" for keys, ms in served.items()]
    if fused:
        lines += ["fused stage, QKVG's tactic (the side chain on the SMs it leaves):"]
        lines += [f"  M = {spans(ms)}: {key}" for key, ms in fused.items()]
    return lines


def write_plot(results: dict[str, Any], path: Path) -> None:
    """Latency vs M for every stage variant, with the HBM floor line (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label in (("seq_cublas", "sequential packed cuBLAS"), ("peers", "peers: cuBLAS + aux stream"),
                       ("vllm_native", "vLLM 0.33's own stage"), ("sglang_native", "SGLang 0.5.23's own stage"),
                       ("ours", "kda-backend plan")):
        points = [(r["m"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.plot([r["m"] for r in rows], [r["floor"] for r in rows], color="k", linestyle="--",
            label="floor (weights / copy BW, or FLOPs / dense rate)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens per step)")
    ax.set_ylabel("us per layer")
    ax.set_title(f"KDA projection stage, {results['device']}, tp{results['geometry']['tp_size']}")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_json(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
