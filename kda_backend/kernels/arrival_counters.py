"""Arrival counters for the split-K kernel's in-kernel reduction and the trailing side chain, one zeroed set per
stream.

Each split-K launch counts its CTAs in per output tile; the last to arrive reduces and resets the tile's counter to
zero, so a set is zero again whenever no kernel using it is running. Kernels on one stream never overlap in their
counter use (with programmatic launch, a kernel touches counters only after ``griddepcontrol.wait``, i.e. after its
predecessor finished; the one exception, F_A/beta trailing QKVG, is released by QKVG only after QKVG's own wait,
see :class:`~kda_backend.kernels.skinny_gemm.Link`), so one set per stream is race-free; kernels on different
streams get different sets. The last three counters of a set belong to the side chain trailing QKVG on one stream
(:class:`~kda_backend.kernels.skinny_gemm.Link`, :mod:`~kda_backend.kernels.side_chain_gemm`): its launches use them
together and leave them at zero before the next side chain on the stream can touch them.

The sets are rows of one zero-initialised arena per device, allocated on first use outside capture (the provider's
``prepare`` reserves it before any capture; inside a capture a missing arena is an error, like an uncompiled
kernel). Handing a row to a stream first seen inside a capture (a side stream) is host bookkeeping only, so nothing
is allocated or zeroed inside the graph.

An engine that releases its weights' memory and later maps it again (vLLM's sleep level 2, SGLang's memory saver)
takes the arena with it where it was allocated during model loading, and restores its model's buffers only: the
adapters therefore register the arena as a non-persistent buffer of each layer
(:meth:`~kda_backend.projection.KDAProjection.state_buffers`), saved while it is zero and written back on resume.

A captured graph keeps the row of the stream its split-K kernels were captured on. Graphs captured on the same
stream therefore share a row, so they must not be replayed concurrently. The engines replay one graph at a time.
"""

from __future__ import annotations

import threading

import torch

COUNTERS_PER_STREAM = 256  # output tiles of one launch, ceil(N / block_n) * ceil(M / block_t): Kimi-K3 F_A/beta 9-14
CHAIN_COUNTERS = 3  # the last three of a row: the trailing side chain's (see skinny_gemm.Link, side_chain_gemm)
SPLIT_K_COUNTERS = COUNTERS_PER_STREAM - CHAIN_COUNTERS
STREAMS_PER_DEVICE = 1024  # streams are rarely destroyed in serving; 1 MiB per device covers test churn too


class ArrivalCounters:
    """Process-wide: per device an int32 arena ``[STREAMS_PER_DEVICE, COUNTERS_PER_STREAM]``, a row per stream."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arenas: dict[int, torch.Tensor] = {}
        self._rows: dict[tuple[int, int], int] = {}

    def reserve(self, device: torch.device) -> None:
        """Allocate ``device``'s zeroed arena (idempotent); must run before capturing graphs that use it."""
        index = torch.device(device).index
        self._arena(torch.cuda.current_device() if index is None else index)

    def arena(self, device: torch.device) -> torch.Tensor | None:
        """``device``'s arena ``[STREAMS_PER_DEVICE, COUNTERS_PER_STREAM]`` int32 where it was reserved, else
        ``None``."""
        index = torch.device(device).index
        with self._lock:
            return self._arenas.get(torch.cuda.current_device() if index is None else index)

    def _arena(self, index: int) -> torch.Tensor:
        with self._lock:
            arena = self._arenas.get(index)
            if arena is None:
                if torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(
                        f"split-K arrival counters of cuda:{index} were not reserved before CUDA-graph capture; "
                        "call prepare() first"
                    )
                arena = self._arenas[index] = torch.zeros(
                    STREAMS_PER_DEVICE, COUNTERS_PER_STREAM, dtype=torch.int32, device=torch.device("cuda", index)
                )
                # Zeroed on the current stream but read from any: finish the memset before anyone uses it.
                torch.cuda.synchronize(index)
            return arena

    def for_stream(self, stream: torch.cuda.Stream, tiles: int) -> torch.Tensor:
        """The split-K counters ``[SPLIT_K_COUNTERS]`` of ``stream`` for a launch with ``tiles`` output tiles."""
        if tiles > SPLIT_K_COUNTERS:
            raise ValueError(f"split-K launch has {tiles} output tiles > {SPLIT_K_COUNTERS} arrival counters")
        return self._row(stream)[:SPLIT_K_COUNTERS]

    def chain_for_stream(self, stream: torch.cuda.Stream) -> torch.Tensor:
        """The trailing side chain's counters ``[CHAIN_COUNTERS]`` of ``stream`` (zero whenever no side chain is
        running)."""
        return self._row(stream)[SPLIT_K_COUNTERS:]

    def _row(self, stream: torch.cuda.Stream) -> torch.Tensor:
        arena = self._arena(stream.device_index)
        key = (stream.device_index, stream.cuda_stream)
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                used = sum(1 for device, _ in self._rows if device == stream.device_index)
                if used == STREAMS_PER_DEVICE:
                    raise RuntimeError(f"more than {STREAMS_PER_DEVICE} streams ran split-K kernels on one device")
                row = self._rows[key] = used
            return arena[row]


arrival_counters = ArrivalCounters()
