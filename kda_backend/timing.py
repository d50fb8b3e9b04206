"""Measuring the way serving runs: CUDA graphs of many layers whose weights rotate, median of replays.

Weights rotate over ``copies`` sets (>= 6 for Kimi-K3: 6 x 90 MB exceeds L2 many times over), so every layer
reads its weights from HBM as the 69 real layers do. Results are per layer. The copy bandwidth measured in the
same process gives the HBM floor (weight bytes / bandwidth) that ratios are reported against; at large M the floor is
the stage's tensor-core time where that is longer (FLOPs / the dense bf16 rate measured in the same process).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

COPIES = 6  # weight sets a timing graph rotates over: 6 x 90 MB of Kimi-K3 weights exceed L2 many times over
LAYERS = 24  # layers per timing graph


def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available on this machine: nothing can be measured here")
    return torch.device("cuda", torch.cuda.current_device())


def copy_bandwidth(nbytes: int = 4 * 1024**3, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write (as the anchors do)."""
    device = require_cuda()
    src = torch.empty(nbytes // 2 // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    return moved / statistics.median(times)


def dense_bf16_rate(size: int = 8192, reps: int = 10) -> float:
    """FLOP/s ``torch.mm`` reaches on a large square bf16 GEMM: the compute side of the floor (a stage at large M
    may be bound by tensor-core time rather than by its weight bytes)."""
    device = require_cuda()
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, b, out=out)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        torch.mm(a, b, out=out)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b, out
    return 2 * size**3 / statistics.median(times)


_warmup_streams: dict[torch.device, torch.cuda.Stream] = {}


def _warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for warm-ups: torch hands out pooled streams round-robin, so a fresh one per
    measurement would, after 32, alias a caller's aux stream."""
    if device not in _warmup_streams:
        _warmup_streams[device] = torch.cuda.Stream(device)
    return _warmup_streams[device]


def graph_time_per_layer(layer: Callable[[int], object], layers: int = LAYERS, replays: int = 50) -> float:
    """Median seconds per layer of a CUDA graph running ``layer(i)`` for i in range(layers).

    ``layer`` must be capturable (all kernels compiled, no allocation that depends on data).
    """
    side = _warmup_stream(require_cuda())
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(layers):
            layer(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            layer(i)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times) / layers


def eager_time_per_call(
    call: Callable[[int], object], calls: int = 240, rounds: int = 5, burst: int = 8
) -> tuple[float, float]:
    """Eager (no graph) seconds per call of ``call(i)`` over ``calls`` back-to-back calls, and the host's cost:
    seconds to issue one call, timed over bursts of ``burst`` calls that start with an idle GPU, so no launch waits
    for room in the device's launch queue. Medians over ``rounds``.

    Where the host cost per call exceeds the GPU time per call, the GPU waits for the host, as in an engine's eager
    mode (enforce-eager, batches above the largest captured graph, warm-ups).
    """
    require_cuda()
    for i in range(calls):
        call(i)
    torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(calls):
            call(i)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) / calls)
        for first in range(0, calls, burst):
            start = time.perf_counter()
            for i in range(first, first + burst):
                call(i)
            hosts.append((time.perf_counter() - start) / burst)
            torch.cuda.synchronize()
    return statistics.median(walls), statistics.median(hosts)
