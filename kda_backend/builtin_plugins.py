"""Built-in hook implementations, registered ``trylast`` so that any external plugin overrides them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kda_backend.hookspecs import hookimpl
from kda_backend.overlap import fork_while_capturing
from kda_backend.providers.base import GemmProvider
from kda_backend.providers.cute_provider import CuteDslProvider
from kda_backend.providers.flashinfer_provider import FlashInferProvider
from kda_backend.providers.torch_provider import TorchProvider


class BuiltinProviders:
    """Contributes the CuTe DSL provider, the optional FlashInfer provider and the torch/cuBLAS provider that
    serves every call.

    :param cache_dir: the cache folder (asked when needed), where the CuTe provider keeps compiled kernels;
        ``None``: in memory only.
    """

    def __init__(self, cache_dir: Callable[[], Path] | None = None) -> None:
        self.cute = CuteDslProvider(cache_dir)

    @hookimpl(trylast=True)
    def kda_gemm_providers(self) -> list[GemmProvider]:
        return [self.cute, FlashInferProvider(), TorchProvider()]


class DefaultHost:
    """Host answers when no engine adapter is registered: standalone use, tests, benchmarks."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    @hookimpl(trylast=True)
    def kda_host_fork_allowed(self, device: torch.device) -> bool:
        return fork_while_capturing(device)

    @hookimpl(trylast=True)
    def kda_host_aux_stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device=device)
            return self._streams[device]

    @hookimpl(trylast=True)
    def kda_autotune_cache_dir(self) -> Path:
        return Path.home() / ".cache" / "kda_backend"

    @hookimpl(trylast=True)
    def kda_share_plan(self, plan: dict[str, Any]) -> dict[str, Any]:
        return plan


def builtin_plugins(cache_dir: Callable[[], Path] | None = None) -> dict[str, object]:
    """Name -> plugin object for every built-in plugin (always registered: ``KDA_BACKEND_BLOCK_PLUGINS`` naming one
    warns and keeps it); ``cache_dir`` as for :class:`BuiltinProviders` (the plugin manager passes its own resolution
    of the cache folder)."""
    return {"builtin-providers": BuiltinProviders(cache_dir), "builtin-host": DefaultHost()}
