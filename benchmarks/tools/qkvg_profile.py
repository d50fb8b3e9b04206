"""QKVG kernels under Nsight Compute: cuBLAS's QKVG (``torch.mm``) and each named CuTe tactic, one launch each per M,
between ``cudaProfilerStart`` and ``cudaProfilerStop`` (Kimi-K3, TP 8 or ``--tp``).

Every kernel is compiled and run on each weight copy first; the profiled launch then reads a copy other than the one
the launch before it read, as in a graph of many layers. Run the script under ``ncu --profile-from-start off`` so
Nsight Compute reads exactly those launches; it prints, in order, the kernels it is about to profile.

Example (GPU): ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
                   --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \\
                   python benchmarks/tools/qkvg_profile.py 64,128 w48k64s9p
"""

from __future__ import annotations

import argparse

import torch
from stage_operands import TACTIC_HELP, StageOperands, kimi_k3, parse_tactic, token_counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ms", type=token_counts, help="comma-separated token counts M, e.g. 64,128")
    ap.add_argument("qkvg", help=f"comma-separated QKVG tactics profiled after cuBLAS's; {TACTIC_HELP}")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel size of the Kimi-K3 shapes (default 8)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Parsed before the GPU is touched: a key that does not parse stops the run there.
    tactics = {m: [parse_tactic(spec, m) for spec in args.qkvg.split(",")] for m in args.ms}
    _, weights, _ = kimi_k3(args.tp)
    for m in args.ms:
        ops = StageOperands(weights, m)

        runs = [("cuBLAS (torch.mm)", ops.qkvg_cublas)]
        for tactic in tactics[m]:
            runs.append((tactic.key(), lambda i, tactic=tactic, ops=ops: ops.qkvg_gemm(tactic, i)))
        for _, run in runs:
            for i in range(ops.copies):
                run(i)
        torch.cuda.synchronize()
        for name, run in runs:
            run(0)
            print(f"M={m} profiling {name}", flush=True)
            torch.cuda.profiler.start()
            run(1)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
