"""The CuTe DSL skinny GEMM alone: correctness per role, TP size and M, then a sweep of QKVG tactics (Kimi-K3, TP8).

First, unless ``--skip-check``, every role's default tactic at TP 1, 8 and 16 and M = 1..64 against fp32 (output
poisoned with NaN first, bit-identical on a second launch). Then, for each M, every QKVG candidate tactic (or the
subset the filters keep) alone, in us per call (median of 50 replays of a CUDA graph of 24 calls whose weights
rotate over 6 copies), as a percentage of the device-to-device copy bandwidth measured in the same process, and
against cuBLAS (``torch.mm``) on the same operands: the 8 fastest per M.

Example (GPU): python benchmarks/tools/kernel_sweep.py --skip-check --ms 1,8,16 --block-n 16,48 --block-k 256
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kda_backend.geometry import preset
from kda_backend.kernels.skinny_gemm import candidate_tactics, default_tactic
from kda_backend.providers.cute_provider import launch
from kda_backend.timing import copy_bandwidth, graph_time_per_layer

COPIES = 6


def check(n, k, x_stride, m, tactic, dev):
    base = torch.randn(m, x_stride, device=dev, dtype=torch.bfloat16)
    x = base[:, :k]
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
    out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
    launch(tactic, x, w, out)
    torch.cuda.synchronize()
    ref = x.float() @ w.float().t()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    again = torch.full_like(out, float("nan"))
    launch(tactic, x, w, again)
    ok = err < 1e-2 and not out.isnan().any().item() and torch.equal(out, again)
    return ok, err


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="M = 1, 4, 8, 16 and 128-element K-tiles of 4, 6 or 8 stages")
    ap.add_argument("--skip-check", action="store_true", help="skip the correctness check")
    ap.add_argument("--ms", default="1,2,4,8,12,16", help="comma-separated token counts M (default 1,2,4,8,12,16)")
    ap.add_argument("--block-k", default="", help="comma-separated K-tile sizes to keep (default: all)")
    ap.add_argument("--block-n", default="", help="comma-separated weight rows per CTA to keep (default: all)")
    ap.add_argument("--stages", default="", help="comma-separated ring depths to keep (default: all)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is not available on this machine: nothing can be measured here", file=sys.stderr)
        raise SystemExit(2)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    # Correctness
    fails = 0
    t0 = time.time()
    for tp in () if args.skip_check else (1, 8, 16):
        g = preset("kimi-k3", tp)
        for role, n, k, xs in (("qkvg", g.qkvg_rows, g.hidden_size, g.hidden_size),
                               ("fab", g.fab_rows, g.hidden_size, g.hidden_size),
                               ("fb", g.local_width, g.head_dim, g.fab_rows)):
            for m in (1, 3, 8, 13, 16, 24, 32, 64):
                tac = default_tactic(n, k, m)
                ok, err = check(n, k, xs, m, tac, dev)
                fails += not ok
                if not ok or m in (1, 16):
                    print(f"check tp{tp} {role} N={n} K={k} M={m} {tac.key()} err={err:.2e} "
                          f"{'OK' if ok else 'FAIL'}", flush=True)
    print(f"correctness: {fails} failures ({time.time()-t0:.1f}s)", flush=True)

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw/1e12:.3f} TB/s", flush=True)
    g = preset("kimi-k3", 8)
    n, k = g.qkvg_rows, g.hidden_size
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
    floor = n * k * 2 / bw
    ms = (1, 4, 8, 16) if args.quick else tuple(int(v) for v in args.ms.split(","))
    for m in ms:
        xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
        outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
        t_cublas = graph_time_per_layer(lambda i: torch.mm(xs[i % COPIES], ws[i % COPIES].t(), out=outs[i % COPIES]))
        results = []
        cands = candidate_tactics(n, k, m, k)
        if args.quick:
            cands = [c for c in cands if c.block_k == 128 and c.stages in (4, 6, 8)]
        if args.block_k:
            cands = [c for c in cands if str(c.block_k) in args.block_k.split(",")]
        if args.stages:
            cands = [c for c in cands if str(c.stages) in args.stages.split(",")]
        if args.block_n:
            cands = [c for c in cands if str(c.block_n) in args.block_n.split(",")]
        for tac in cands:
            try:
                launch(tac, xs[0], ws[0], outs[0])  # compiles before capture
                t = graph_time_per_layer(lambda i: launch(tac, xs[i % COPIES], ws[i % COPIES], outs[i % COPIES]))
                results.append((t, tac))
            except Exception as exc:  # report and keep sweeping
                print(f"  {tac.key()} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        results.sort(key=lambda r: r[0])
        print(f"M={m}: cuBLAS {t_cublas*1e6:.2f} us ({floor/t_cublas*100:.1f}% of copy bw)", flush=True)
        for t, tac in results[:8]:
            print(f"  {tac.key():18s} {t*1e6:7.2f} us  {floor/t*100:5.1f}%  x{t_cublas/t:.3f} vs cuBLAS", flush=True)


if __name__ == "__main__":
    main()
