"""Event-based fork/join of the projection's side chain onto an auxiliary stream.

Order matters inside CUDA graphs: the fork event is recorded and the main-stream GEMM issued *before* switching to
the aux stream (as SGLang does), so replay does not fan out into extra streams. The join event is waited on by the
main stream before returning, so a capture never ends with an unjoined stream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def fork_while_capturing(device: torch.device) -> bool:
    """The fork rule of a full CUDA graph: fork exactly while the current stream of a CUDA ``device`` is being
    captured (the built-in host's answer, and the autotuner's for its own graphs)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class OverlapScheduler:
    """One per layer: owns its fork/join events (created once, on first use)."""

    def __init__(self) -> None:
        self._fork: torch.cuda.Event | None = None
        self._join: torch.cuda.Event | None = None

    def run(self, main: Callable[[], None], side: Callable[[], None], aux_stream: torch.cuda.Stream) -> None:
        """Run ``main`` on the current stream and ``side`` on ``aux_stream`` concurrently; joined on return."""
        if self._fork is None:
            self._fork, self._join = torch.cuda.Event(), torch.cuda.Event()
        current = torch.cuda.current_stream()
        if aux_stream == current:
            raise ValueError("aux_stream must differ from the current stream to overlap")
        self._fork.record(current)
        main()
        with torch.cuda.stream(aux_stream):
            aux_stream.wait_event(self._fork)
            side()
            self._join.record(aux_stream)
        current.wait_event(self._join)
