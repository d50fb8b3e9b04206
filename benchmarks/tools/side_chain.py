"""F_A/beta and F_B tactics inside the overlapped projection stage (Kimi-K3, TP8).

Alone, split-K F_A/beta (many small CTAs) is fastest; beside QKVG what counts is how much the side chain slows
QKVG's CTAs, which depends on where its CTAs land. For each F_A/beta tactic, F_B tactic and M, prints the CTA
count, the overlapped stage (QKVG on the main stream, F_A/beta -> F_B forked onto an aux stream) and F_A/beta
alone, in us per layer (medians of 50 replays of a CUDA graph of 24 layers whose weights rotate over 6 copies).

Example (GPU): python benchmarks/tools/side_chain.py 2,8,16 n16k128s3x14p,split n16k128s3pL n48k256s4p
"""

from __future__ import annotations

import argparse
import dataclasses

from stage_operands import (
    TACTIC_HELP,
    StageOperands,
    kimi_k3,
    overlapped_time,
    parse_tactic,
    tactic_or_default,
    token_counts,
)

from kda_backend.kernels.skinny_gemm import Tactic, block_t_for
from kda_backend.timing import graph_time_per_layer

# Named groups of F_A/beta tactics (token tile 16): split-K depths, whole-K (9 CTAs), finer splits, and 48-row
# split-K CTAs, each reading x for three times the rows of a 16-row CTA (x read a third as often).
FAB_GROUPS = {
    "split": [Tactic(16, 128, 16, 2, split_k=s) for s in (14, 7, 4, 2)],
    "whole-k": [Tactic(16, 256, 16, 4), Tactic(16, 128, 16, 4), Tactic(16, 256, 16, 6), Tactic(16, 128, 16, 8)],
    "fine-split": [Tactic(16, 128, 16, 2, split_k=28), Tactic(16, 64, 16, 2, split_k=14),
                   Tactic(16, 64, 16, 2, split_k=28), Tactic(16, 64, 16, 2, split_k=56),
                   Tactic(16, 64, 16, 3, split_k=28)],
    "wide-split": [Tactic(48, 64, 16, s, x_via_l1=False, split_k=k) for s, k in ((3, 7), (3, 14), (3, 28), (2, 28),
                                                                              (2, 56))],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ms", type=token_counts, help="comma-separated token counts M, e.g. 2,8,16")
    ap.add_argument("fab", help=f"comma-separated F_A/beta tactics or groups ({', '.join(FAB_GROUPS)}); {TACTIC_HELP}")
    ap.add_argument("fb", nargs="?", help="comma-separated F_B tactics, each timed with every F_A/beta tactic "
                    "(default: F_B's default tactic)")
    ap.add_argument("qkvg", nargs="?", help="QKVG's tactic (default: its default tactic)")
    return ap.parse_args(argv)


def fab_tactics(spec: str, m: int) -> list[Tactic]:
    """The tactics a comma-separated list of keys and group names stands for, at ``m`` tokens."""
    out = []
    for item in spec.split(","):
        if item in FAB_GROUPS:
            out += [dataclasses.replace(t, block_t=block_t_for(m)) for t in FAB_GROUPS[item]]
        else:
            out.append(parse_tactic(item, m))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    g, weights, aux = kimi_k3()
    for m in args.ms:
        ops = StageOperands(weights, m)
        t_qkvg = tactic_or_default(args.qkvg, "qkvg", g, m)
        fbs = [tactic_or_default(k, "fb", g, m) for k in (args.fb.split(",") if args.fb else [None])]
        for t_fab in fab_tactics(args.fab, m):
            ctas = g.fab_rows // t_fab.block_n * t_fab.split_k
            for t_fb in fbs:

                def qkvg(i):
                    ops.qkvg_gemm(t_qkvg, i)

                def side(i, t_fab=t_fab, t_fb=t_fb):
                    ops.fab_gemm(t_fab, i)
                    ops.fb_gemm(t_fb, i)

                try:
                    for i in range(len(weights)):  # compile everything before capture
                        qkvg(i)
                        side(i)
                    stage = overlapped_time(qkvg, side, aux) * 1e6
                    alone = graph_time_per_layer(lambda i, t_fab=t_fab: ops.fab_gemm(t_fab, i)) * 1e6
                    print(f"fab={t_fab.key():18} CTAs={ctas:3} fb={t_fb.key():16} qkvg={t_qkvg.key()} M={m:2}: "
                          f"overlapped stage {stage:6.2f} us, F_A/beta alone {alone:6.2f} us", flush=True)
                except Exception as exc:  # an invalid tactic for this shape: report it and time the others
                    print(f"fab={t_fab.key()} fb={t_fb.key()} M={m}: FAILED {type(exc).__name__}: {exc}"[:300],
                          flush=True)


if __name__ == "__main__":
    main()
