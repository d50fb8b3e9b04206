"""GPU time per layer of the full ``KimiK3DeltaAttention`` decode step under each of several stored plans, alternated
in one process, so that plans are compared under the same clocks (one process's timing can read a few per cent off
another's). ``bench``'s layer rows compare its one plan with sequential cuBLAS the same way.

For each M and each of ``ROUNDS`` rounds, every plan's decode step is timed in turn as ``bench`` times its layer rows
(:class:`kda_backend.decode_step.DecodeStepTimer`: a CUDA graph of 24 layers over 6 weight copies, median of replays),
then the median over the rounds per plan is printed with its ratio to the first plan's. The name ``cublas`` stands for
the plan of sequential cuBLAS (``bench``'s ``seq_cuBLAS``, the engines' own eager path).

Example (GPU): python benchmarks/tools/decode_step_plans.py --tp 16 1,4,16 new/plan.json old/plan.json
               python benchmarks/tools/decode_step_plans.py 1,16,64,128 plan.json cublas
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from stage_operands import read_plan, require_cuda, token_counts

from kda_backend.decode_step import DecodeStepTimer
from kda_backend.geometry import preset
from kda_backend.plan import SEQUENTIAL_CUBLAS

ROUNDS = 3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ms", type=token_counts, help="comma-separated token counts M, e.g. 1,4,16")
    ap.add_argument("plans", nargs="+", help="stored plan files (`kda-backend autotune` wrote them), or cublas")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel size of the Kimi-K3 shapes (default 8)")
    args = ap.parse_args(argv)
    require_cuda()
    device = torch.device("cuda", torch.cuda.current_device())
    geometry = preset("kimi-k3", args.tp)
    plans = {name: SEQUENTIAL_CUBLAS if name == "cublas" else read_plan(Path(name), "plan") for name in args.plans}
    decode_steps = DecodeStepTimer(geometry, device)
    for m in args.ms:
        times = decode_steps.times(plans, m, ROUNDS)
        first = statistics.median(times[args.plans[0]])
        for name, found in times.items():
            median = statistics.median(found)
            print(f"M={m:3} {name:40} decode step {median:7.2f} us ({median / first:.3f}x the first plan; "
                  f"rounds {', '.join(f'{t:.2f}' for t in found)})", flush=True)


if __name__ == "__main__":
    main()
