"""GPU time per layer of the projection stage's three forms (Kimi-K3, TP8), the same kernels' tiles in each.

- forked: QKVG on the main stream, the side chain forked onto an aux stream (full-graph decode);
- trailing: QKVG's launch, then the side chain trailing it on the same stream (piecewise graphs);
- one launch: the whole stage in one launch (eager calls, where the host's launch cost exceeds the GPU time).

Each is timed from a CUDA graph of 24 layers whose weights rotate over 6 copies (median of 50 replays), with the
CuTe kernels' default tactics (or ``--qkvg``'s tactic for QKVG), forms alternated over 3 rounds.

Example (GPU): python benchmarks/tools/stage_forms.py 1,4,16,32 --qkvg n48k256s4p
"""

from __future__ import annotations

import argparse
import statistics

from stage_operands import LAYERS, StageOperands, kimi_k3_tp8, overlapped_time, parse_tactic, token_counts

from kda_backend.plan import Plan, Step
from kda_backend.projection import KDAProjection
from kda_backend.stages import run_side_chain
from kda_backend.timing import graph_time_per_layer

ROUNDS = 3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ms", type=token_counts, help="comma-separated token counts M, e.g. 1,16")
    ap.add_argument("--qkvg", help="QKVG's tactic key without the token tile (default: its default tactic)")
    args = ap.parse_args(argv)
    g, weights, aux = kimi_k3_tp8()
    for m in args.ms:
        tactics = {("qkvg", g.qkvg_rows, g.hidden_size, m): parse_tactic(args.qkvg, m)} if args.qkvg else {}
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

        forms = {"forked": lambda: overlapped_time(qkvg, side, aux),
                 "trailing": lambda: graph_time_per_layer(trailing, layers=LAYERS),
                 "one launch": lambda: graph_time_per_layer(one_launch, layers=LAYERS)}
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
