"""Host time of one eager projection call (no CUDA graph) and of its parts (Kimi-K3).

An eager call's GPU work at small M is shorter than the time the host takes to issue it, so the host's cost is
the call's cost. For each M this prints the host microseconds to issue: the whole call (outputs allocated, and
into given buffers), the stage alone, its one-launch form, one CuTe QKVG launch, that launch with the side chain
trailing it, the input check, the fork question to the host, three output allocations, and three ``torch.mm``
calls for comparison.
Each is the median over bursts of 8 calls issued from an idle GPU (so no launch waits for room in the launch
queue), one synchronization after each burst. The plan is overlapped with the CuTe kernels' default tactics.

Example (GPU): python benchmarks/tools/eager_host_profile.py 1,16 --tp 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from stage_operands import require_cuda, token_counts

from kda_backend.autotune import make_weight_copies
from kda_backend.geometry import preset
from kda_backend.plan import Plan, Step
from kda_backend.plugins import hooks
from kda_backend.projection import KDAProjection

BURSTS, BURST = 200, 8


def host_us(call: Callable[[], object]) -> float:
    """Median host microseconds to issue ``call`` once, over bursts of :data:`BURST` from an idle GPU."""
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(BURSTS):
        start = time.perf_counter()
        for _ in range(BURST):
            call()
        times.append((time.perf_counter() - start) / BURST)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ms", type=token_counts, help="comma-separated token counts M, e.g. 1,16")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel size (default 8)")
    args = ap.parse_args(argv)
    require_cuda()
    g = preset("kimi-k3", args.tp)
    w = make_weight_copies(g, torch.device("cuda"), copies=1)[0]
    proj = KDAProjection(w, Plan.uniform(max(args.ms), Step(overlap=True, qkvg="cute", fab="cute", fb="cute")))
    print(torch.cuda.get_device_name(), torch.__version__, f"tp{args.tp}", flush=True)
    for m in args.ms:
        proj.prepare([m])
        stage = proj.stage(m)
        x = torch.randn(m, g.hidden_size, device="cuda", dtype=torch.bfloat16)
        qkvg, fab, g1 = (torch.empty(m, cols, device="cuda", dtype=torch.bfloat16)
                         for cols in (g.qkvg_rows, g.fab_rows, g.local_width))
        rows = {
            "proj(x)": lambda: proj(x),
            "proj(x, outputs)": lambda: proj(x, qkvg, fab, g1),
            "stage.run": lambda: stage.run(x, w, qkvg, fab, g1),
            "stage in one launch": (lambda: stage.whole(x, w.w_qkvg, qkvg, w.w_fab, fab, w.w_fb, g1))
            if stage.whole else None,
            "QKVG launch": lambda: stage.qkvg.launch(x, w.w_qkvg, qkvg),
            # The side chain only ever trails its own QKVG launch (F_A/beta loads x without waiting; two side chains
            # back to back would share the stream's counters at once).
            "QKVG + side chain": (lambda: (stage.qkvg.launch(x, w.w_qkvg, qkvg),
                                           stage.trail(x, w.w_fab, fab, w.w_fb, g1))) if stage.trail else None,
            "validate_input": lambda: proj.validate_input(x),
            "fork_allowed": lambda: hooks.fork_allowed(x.device),
            "3 output allocations": lambda: (x.new_empty(m, g.qkvg_rows), x.new_empty(m, g.fab_rows),
                                             x.new_empty(m, g.local_width)),
            "3 torch.mm": lambda: (torch.mm(x, w.w_qkvg.t(), out=qkvg), torch.mm(x, w.w_fab.t(), out=fab),
                                   torch.mm(fab[:, : g.head_dim], w.w_fb.t(), out=g1)),
        }
        print(f"M={m}")
        for name, call in rows.items():
            print(f"  {name:22s} " + (f"{host_us(call):7.2f} us" if call is not None else "  (not built for this M)"),
                  flush=True)


if __name__ == "__main__":
    main()
