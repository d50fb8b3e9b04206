"""How fast the SMs pull data out of L2 and HBM, which a skinny GEMM whose every CTA reads all activations depends on.

At M tokens each QKVG CTA of the swap-AB wgmma kernel reads its weight rows once from HBM and all M x K activations
from L2 (Kimi-K3 TP 8, M = 128: 688 KB of weights and 1.84 MB of activations per SM). This tool times a read-only
kernel (Triton, so it is independent of the project's kernels) that sums tiles of a buffer, one program per CTA:

- ``l2-shared``: every program reads the same buffer of ``--shared-mb`` MB (the activations' case; L2-resident);
- ``l2-own``: each program reads its own slice of a buffer of ``--own-mb`` MB (L2-resident; large grids wrap it);
- ``hbm``: each program streams its own slice of a 2 GiB buffer (the weights' case).

For each source and grid size it prints the time of a launch that reads 2 MB per program and the bytes read per us
in all and per program, from the difference between launches reading 2 MB and 4 MB per program (so the launch's
fixed cost drops out). One program per SM keeps too few reads in flight to find the limit (35-40 GB/s each on H200),
so the default grids run 1 to 16 programs per SM; where the total stops growing is what the SMs can pull together.
Reads are 16-byte vector loads (``--tma``: Triton tensor descriptors, the TMA unit on Hopper).

Example (GPU): python benchmarks/tools/l2_ingress.py --grids 132,528,2112
"""

from __future__ import annotations

import argparse
import statistics

import torch
from stage_operands import require_cuda

TILE_ELEMS = 8192  # bf16 elements one program reads per iteration: 16 KB, an activation K-tile at M = 128
READS_PER_PROGRAM = 2 * 1024 * 1024  # bytes each program reads per launch (one SM's share at M = 128 is 2.5 MB)
HBM_BYTES = 2 * 1024**3
SOURCES = ("l2-shared", "l2-own", "hbm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grids", default="132,264,528,1056,2112",
                    help="comma-separated program counts (default: %(default)s)")
    ap.add_argument("--shared-mb", type=float, default=1.84, help="l2-shared buffer in MB (default: %(default)s)")
    ap.add_argument("--own-mb", type=float, default=24.0, help="l2-own buffer in MB, all slices (default: %(default)s)")
    ap.add_argument("--warps", type=int, default=8, help="warps per program (default: %(default)s)")
    ap.add_argument("--stages", type=int, default=4, help="Triton software-pipeline stages (default: %(default)s)")
    ap.add_argument("--tma", action="store_true", help="read through tensor descriptors (TMA) instead of loads")
    args = ap.parse_args(argv)
    try:
        args.grids = [int(g) for g in args.grids.split(",")]
    except ValueError:
        ap.error(f"--grids must be comma-separated integers, got {args.grids!r}")
    if any(g < 1 for g in args.grids):
        ap.error(f"--grids must be positive, got {args.grids}")
    if args.warps not in (1, 2, 4, 8, 16, 32):
        ap.error(f"--warps must be a power of 2 from 1 to 32, got {args.warps}")
    if args.stages < 1 or args.shared_mb <= 0 or args.own_mb <= 0:
        ap.error(f"--stages, --shared-mb and --own-mb must be positive, got {args.stages}, {args.shared_mb}, "
                 f"{args.own_mb}")
    return args


def _kernels():
    """The two read kernels, compiled by Triton on first use (imported here: the CPU tests need no Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_loads(src, out, tiles, iters, start_stride, TILE: tl.constexpr, OWN: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, TILE)
        acc = tl.zeros([TILE], dtype=tl.float32)
        base = pid * iters if OWN else pid * start_stride
        for it in range(iters):
            tile = (base + it) % tiles
            acc += tl.load(src + tile.to(tl.int64) * TILE + offs).to(tl.float32)
        tl.store(out + pid * TILE + offs, acc)

    @triton.jit
    def read_tma(desc, out, tiles, iters, start_stride, TILE: tl.constexpr, OWN: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([TILE // 64, 64], dtype=tl.float32)
        base = pid * iters if OWN else pid * start_stride
        for it in range(iters):
            tile = (base + it) % tiles
            acc += desc.load([tile * (TILE // 64), 0]).to(tl.float32)
        rows = tl.arange(0, TILE // 64)[:, None] * 64 + tl.arange(0, 64)[None, :]
        tl.store(out + pid * TILE + rows, acc)

    return read_loads, read_tma


def _launch_us(launch, iters: int) -> float:
    """Median us of ``launch(iters)`` over 20 launches, after 3 warm-up launches."""
    for _ in range(3):
        launch(iters)
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch(iters)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    require_cuda()
    device = torch.device("cuda", torch.cuda.current_device())
    read_loads, read_tma = _kernels()
    iters = READS_PER_PROGRAM // (TILE_ELEMS * 2)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"{torch.cuda.get_device_name(device)}, {sms} SMs; {iters} tiles of {TILE_ELEMS * 2 // 1024} KB per program, "
          f"{args.warps} warps, {args.stages} stages, {'TMA' if args.tma else '16-byte loads'}", flush=True)
    print(f"{'source':>10} {'grid':>5} {'us':>8} {'GB/s all':>9} {'GB/s per program':>17}", flush=True)
    for source in SOURCES:
        nbytes = {"l2-shared": args.shared_mb * 1e6, "l2-own": args.own_mb * 1e6, "hbm": HBM_BYTES}[source]
        tiles = max(1, int(nbytes) // (TILE_ELEMS * 2))
        src = torch.randn(tiles * TILE_ELEMS, device=device, dtype=torch.bfloat16)
        for grid in args.grids:
            out = torch.empty(grid * TILE_ELEMS, device=device, dtype=torch.float32)
            own = source != "l2-shared"
            # Programs start at different tiles so they do not all ask for one line at once; with their own slices
            # (each ``iters`` tiles) none is read twice per launch unless the grid's slices wrap the buffer.
            stride = max(1, tiles // grid)
            if args.tma:
                from triton.tools.tensor_descriptor import TensorDescriptor

                desc = TensorDescriptor.from_tensor(src.view(-1, 64), block_shape=[TILE_ELEMS // 64, 64])

                def launch(n, desc=desc, out=out, grid=grid, own=own, stride=stride, tiles=tiles):
                    read_tma[(grid,)](desc, out, tiles, n, stride, TILE=TILE_ELEMS, OWN=own,
                                      num_warps=args.warps, num_stages=args.stages)
            else:

                def launch(n, src=src, out=out, grid=grid, own=own, stride=stride, tiles=tiles):
                    read_loads[(grid,)](src, out, tiles, n, stride, TILE=TILE_ELEMS, OWN=own,
                                        num_warps=args.warps, num_stages=args.stages)

            short, long = _launch_us(launch, iters), _launch_us(launch, 2 * iters)
            extra = grid * iters * TILE_ELEMS * 2  # bytes the long launch reads beyond the short one
            print(f"{source:>10} {grid:>5} {short:>8.2f} {extra / (long - short) / 1e3:>9.0f} "
                  f"{extra / grid / (long - short) / 1e3:>17.1f}", flush=True)


if __name__ == "__main__":
    main()
