"""GPU time per layer of the projection stage in each form it takes (Kimi-K3, TP8), the same kernels' tiles in each,
and of cuBLAS one after another.

- forked: QKVG on the main stream, the side chain forked onto an aux stream (full-graph decode);
- trailing: QKVG's launch, then the side chain trailing it on the same stream (piecewise graphs);
- one launch: the whole stage in one launch (eager calls, where the host's launch cost exceeds the GPU time);
- one after another: QKVG, F_A/beta and F_B on one stream (where a step can neither fork nor trail);
- cuBLAS one after another: three ``torch.mm`` over split weights (SGLang's sequential path; vLLM's runs one GEMM
  over its packed QKVG and F_A/beta weight, ``bench``'s ``seq_cuBLAS``).

Each is timed from a CUDA graph of 24 layers whose weights rotate over 6 copies (median of 50 replays), forms
alternated over 3 rounds. The CuTe kernels run the tactics of ``--plan`` (a plan file ``kda-backend autotune``
stored), else their defaults; ``--qkvg``, ``--fab`` and ``--fb`` name a tactic for one GEMM instead. The trailing
and one-launch forms are left out at M where the provider does not build them.

Example (GPU): python benchmarks/tools/stage_forms.py 1,4,16,32 --qkvg n48k256s4p
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from stage_operands import (
    LAYERS,
    StageOperands,
    kimi_k3,
    overlapped_time,
    parse_tactic,
    read_plan,
    role_shape,
    token_counts,
)

from kda_backend.kernels.tactics import tactic_bucket
from kda_backend.plan import Plan, Step
from kda_backend.projection import KDAProjection
from kda_backend.stages import run_side_chain
from kda_backend.timing import graph_time_per_layer

ROUNDS = 3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ms", type=token_counts, help="comma-separated token counts M, e.g. 1,16")
    ap.add_argument("--plan", type=Path, help="a stored plan file whose CuTe tactics the kernels run")
    for role in ("qkvg", "fab", "fb"):
        ap.add_argument(f"--{role}", help=f"{role}'s tactic key without the token tile (default: the plan's, else "
                        "the kernel's default tactic)")
    args = ap.parse_args(argv)
    stored = read_plan(args.plan, "--plan").tactics if args.plan else {}
    g, weights, aux = kimi_k3()
    for m in args.ms:
        tactics = dict(stored)
        for role in ("qkvg", "fab", "fb"):
            spec = getattr(args, role)
            if spec:
                tactics[(role, *role_shape(g, role), tactic_bucket(m))] = parse_tactic(spec, m)
        plan = Plan(fallback=Step(overlap=True, qkvg="cute", fab="cute", fb="cute"), tactics=tactics)
        projs = [KDAProjection(w, plan) for w in weights]
        for p in projs:
            p.prepare([m])
        stages = [p.stage(m) for p in projs]
        ops = StageOperands(weights, m)

        def operands(i):
            j = i % len(weights)
            return stages[j], ops.xs[j], weights[j], ops.qkvg[j], ops.fab[j], ops.g1[j]

        def qkvg(i):
            stage, x, w, out, _, _ = operands(i)
            stage.qkvg(x, w.w_qkvg, out)

        def side(i):
            stage, x, w, _, fab, g1 = operands(i)
            run_side_chain(stage.fab, stage.fb, x, w, fab, g1)

        def trailing(i):
            stage, x, w, out, fab, g1 = operands(i)
            stage.qkvg(x, w.w_qkvg, out)
            stage.trail(x, w.w_fab, fab, w.w_fb, g1)

        def one_launch(i):
            stage, x, w, out, fab, g1 = operands(i)
            stage.whole(x, w.w_qkvg, out, w.w_fab, fab, w.w_fb, g1)

        def one_after_another(i):
            qkvg(i)
            side(i)

        def cublas(i):
            _, x, w, out, fab, g1 = operands(i)
            torch.mm(x, w.w_qkvg.t(), out=out)
            torch.mm(x, w.w_fab.t(), out=fab)
            torch.mm(fab[:, : g.head_dim], w.w_fb.t(), out=g1)

        forms = {"forked": lambda: overlapped_time(qkvg, side, aux),
                 "trailing": lambda: graph_time_per_layer(trailing, layers=LAYERS),
                 "one launch": lambda: graph_time_per_layer(one_launch, layers=LAYERS),
                 "one after another": lambda: graph_time_per_layer(one_after_another, layers=LAYERS),
                 "cuBLAS one after another": lambda: graph_time_per_layer(cublas, layers=LAYERS)}
        if stages[0].trail is None:
            del forms["trailing"]
        if stages[0].whole is None:
            del forms["one launch"]
        times = {name: [] for name in forms}
        for _ in range(ROUNDS):
            for name, timed in forms.items():
                times[name].append(timed() * 1e6)
        qkvg_key = stages[0].qkvg.provider.tactic(projs[0].gemm_call("qkvg", m)).key()
        row = "  ".join(f"{name} {statistics.median(t):6.2f} us" for name, t in times.items())
        print(f"M={m:3} qkvg {qkvg_key:18} {row}", flush=True)


if __name__ == "__main__":
    main()
