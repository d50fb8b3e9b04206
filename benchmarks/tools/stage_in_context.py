"""What a plan saves over sequential cuBLAS with the projection stage timed alone, and with a kernel that writes
the stage's activations launched before every stage, as in a decode step (there the previous layer's ``o_proj``
and the engine's RMSNorm write x; no stage follows another stage).

A stage timed alone (``bench``'s stage rows) runs the same few kernels layer after layer: a PDL kernel of one
stage may start while the previous stage drains. Before each stage this tool launches, per context:

- ``alone``: nothing (``bench``'s stage rows);
- ``copy``: ``x.copy_(source)``, an elementwise kernel writing the stage's x;
- ``o_proj``: ``torch.mm(y, W_o^T, out=x)``, a cuBLAS GEMM with ``o_proj``'s shape (``[M, local_width] x
  [hidden, local_width]^T``, its own weight copy per layer) writing x;

and, for reference, the whole ``KimiK3DeltaAttention`` decode step (``bench``'s layer rows). Every context times
in turn, ``ROUNDS`` rounds (CUDA graphs of 24 layers over 6 weight copies, medians): the plan, sequential cuBLAS,
``peers`` (the engines' Hopper overlap of cuBLAS GEMMs, ``bench``'s column), the context's kernel by itself, and
QKVG alone, on the plan's CuTe tactic (the fused stage's where the plan fuses), on cuBLAS and on the tactics
``--qkvg`` names. It prints what the plan saves over each baseline, and what the context adds to each stage beyond its
own kernel's time (the part of a stage that the previous stage hid).

Example (GPU): python benchmarks/tools/stage_in_context.py 1,16,64,128 plan.json
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from stage_operands import TACTIC_HELP, parse_tactic, read_plan, require_cuda, token_counts

from kda_backend import dispatch
from kda_backend.autotune import make_weight_copies
from kda_backend.bench import PEERS
from kda_backend.decode_step import DecodeStepTimer
from kda_backend.geometry import preset
from kda_backend.kernels.wgmma_stage import fused_stage_tactic
from kda_backend.plan import SEQUENTIAL_CUBLAS, Plan
from kda_backend.projection import KDAProjection
from kda_backend.providers.cute_provider import launch
from kda_backend.timing import COPIES, LAYERS, graph_time_per_layer

ROUNDS = 3
CONTEXTS = ("alone", "copy", "o_proj")  # "alone" first: the others are reported against it
VARIANTS = ("plan", "seq_cuBLAS", "peers", "context only", "QKVG cute", "QKVG cuBLAS")


class Operands:
    """Per weight copy: the stage's x, what the contexts write it from, and the QKVG output."""

    def __init__(self, weights, m: int) -> None:
        g, device = weights[0].geometry, weights[0].device
        bf16 = {"device": device, "dtype": torch.bfloat16}
        self.weights = weights
        self.xs = [torch.randn(m, g.hidden_size, **bf16) for _ in weights]
        self.sources = [torch.randn_like(x) for x in self.xs]
        self.ys = [torch.randn(m, g.local_width, **bf16) for _ in weights]
        self.w_os = [torch.randn(g.hidden_size, g.local_width, **bf16) * g.local_width**-0.5 for _ in weights]
        self.outs = [torch.empty(m, g.qkvg_rows, **bf16) for _ in weights]

    def write_x(self, c: int, context: str) -> None:
        if context == "copy":
            self.xs[c].copy_(self.sources[c])
        elif context == "o_proj":
            torch.mm(self.ys[c], self.w_os[c].t(), out=self.xs[c])


def variant_call(ops: Operands, plans: dict[str, Plan], variant: str, m: int) -> Callable[[int], object]:
    """``call(c)``: the variant's work on weight copy ``c`` (the context's kernel not included); a variant that is
    none of :data:`VARIANTS` is a QKVG tactic key."""
    if variant in plans:
        projs = [KDAProjection(w, plans[variant]) for w in ops.weights]
        for p in projs:
            p.prepare([m])
        return lambda c: projs[c](ops.xs[c])
    if variant == "context only":
        return lambda c: None
    w_qkvg = [w.of_role("qkvg") for w in ops.weights]
    if variant == "QKVG cuBLAS":
        return lambda c: torch.mm(ops.xs[c], w_qkvg[c].t(), out=ops.outs[c])
    if variant != "QKVG cute":
        tactic = parse_tactic(variant, m)
        return lambda c: launch(tactic, ops.xs[c], w_qkvg[c], ops.outs[c])
    g = ops.weights[0].geometry
    tactic = fused_stage_tactic(g.qkvg_rows, g.hidden_size, m) if plans["plan"].step(m).fused else None
    if tactic is None:
        proj = KDAProjection(ops.weights[0], plans["plan"])
        tactic = dispatch.provider_by_name("cute").tactic(proj.gemm_call("qkvg", m))
    return lambda c: launch(tactic, ops.xs[c], w_qkvg[c], ops.outs[c])


def context_times(
    ops: Operands, plans: dict[str, Plan], m: int, context: str, qkvg_keys: list[str]
) -> dict[str, float]:
    """Microseconds per layer of each of :data:`VARIANTS` and QKVG alone on each tactic of ``qkvg_keys``, each
    layer's work preceded by ``context``'s kernel."""
    variants = [*VARIANTS, *qkvg_keys]
    if plans["plan"].step(m).qkvg != "cute":
        variants.remove("QKVG cute")
    if context == "alone":
        variants.remove("context only")  # an empty graph
    calls = {v: variant_call(ops, plans, v, m) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in calls}
    for _ in range(ROUNDS):
        for v, call in calls.items():

            def layer(i: int, call=call) -> None:
                c = i % len(ops.xs)
                ops.write_x(c, context)
                call(c)

            times[v].append(graph_time_per_layer(layer, layers=LAYERS) * 1e6)
    return {v: statistics.median(t) for v, t in times.items()}


def report(m: int, context: str, t: dict[str, float], own: float) -> None:
    cells = "  ".join(f"{v} {x:6.2f}" for v, x in t.items() if v != "context only")
    print(f"M={m:3} {context:7} {cells}  context only {own:5.2f}  saved vs seq {t['seq_cuBLAS'] - t['plan']:5.2f}"
          f" vs peers {t['peers'] - t['plan']:5.2f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ms", type=token_counts, help="comma-separated token counts M, e.g. 1,16,64")
    ap.add_argument("plan", type=Path, help="stored plan file (`kda-backend autotune` wrote it)")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel size of the Kimi-K3 shapes (default 8)")
    ap.add_argument("--qkvg", default="", help=f"comma-separated QKVG tactics also timed alone; {TACTIC_HELP}")
    args = ap.parse_args(argv)
    qkvg_keys = [k for k in args.qkvg.split(",") if k]
    for key in qkvg_keys:
        parse_tactic(key, 1)  # a key that does not parse exits here, naming it
    require_cuda()
    device = torch.device("cuda", torch.cuda.current_device())
    geometry = preset("kimi-k3", args.tp)
    plan = read_plan(args.plan, "plan")
    plans = {"plan": plan, "seq_cuBLAS": SEQUENTIAL_CUBLAS, "peers": Plan(fallback=PEERS)}
    weights = make_weight_copies(geometry, device, COPIES)
    decode_steps = DecodeStepTimer(geometry, device)
    print("us per layer; +ctx: what the context adds beyond its own kernel's time", flush=True)
    for m in args.ms:
        ops = Operands(weights, m)
        alone = context_times(ops, plans, m, "alone", qkvg_keys)
        report(m, "alone", alone, 0.0)
        for context in CONTEXTS[1:]:
            t = context_times(ops, plans, m, context, qkvg_keys)
            own = t.pop("context only")
            report(m, context, t, own)
            print(f"M={m:3} {context:7} +ctx " + "  ".join(f"{v} {x - own - alone[v]:+5.2f}" for v, x in t.items()),
                  flush=True)
        steps = decode_steps.times({k: plans[k] for k in ("plan", "seq_cuBLAS")}, m, ROUNDS)
        ours, seq = (statistics.median(steps[k]) for k in ("plan", "seq_cuBLAS"))
        print(f"M={m:3} decode step  plan {ours:7.2f}  seq_cuBLAS {seq:7.2f}  saved {seq - ours:5.2f} "
              f"(seq/plan {seq / ours:.3f})", flush=True)


if __name__ == "__main__":
    main()
