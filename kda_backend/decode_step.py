"""GPU time of the whole ``KimiK3DeltaAttention`` decode step under a plan: the projection stage, the short
convolution, the decay gate, fla's fused recurrent KDA step, the gated RMS norm and ``o_proj``.

A projection stage timed alone follows a stage of the same kernels, whose drain hides its start; in the decode step
other kernels run before it, and what it saves there can be smaller (H200, TP 4, M = 96..128: a stage timed 2.1-3.7
us faster than sequential cuBLAS's left the decode step 0.2-0.9 us slower, ``benchmarks/RESULTS.md``). The
autotuner weighs its choice against sequential cuBLAS here too (:func:`kda_backend.autotune.confirm_in_decode_step`),
and ``bench`` reports it.

Timed as every stage is (:mod:`kda_backend.timing`): a CUDA graph of ``LAYERS`` layers rotating over ``COPIES``
layers' weights, so nothing is served from L2; CUDA only (fla's kernels).
"""

from __future__ import annotations

import torch

from kda_backend.geometry import KDAGeometry
from kda_backend.layer import KimiK3DeltaAttention
from kda_backend.plan import Plan
from kda_backend.reference import KDALayerWeights
from kda_backend.timing import COPIES, LAYERS, graph_time_per_layer


class DecodeStepTimer:
    """``copies`` Kimi-K3 KDA layers with random weights on ``device``, built once and timed under any plan.

    :param geometry: per-rank shapes.
    :param device: a CUDA device.
    """

    def __init__(self, geometry: KDAGeometry, device: torch.device, copies: int = COPIES) -> None:
        self.geometry, self.device = geometry, device
        gen = torch.Generator().manual_seed(0)
        self.layers = [
            KimiK3DeltaAttention(geometry, KDALayerWeights.random(geometry, gen, device=str(device)))
            for _ in range(copies)
        ]

    def seconds_per_layer(self, plan: Plan, m: int) -> float:
        """Median seconds per layer of the decode step of ``m`` sequences (one token each) under ``plan``."""
        g = self.geometry
        for layer in self.layers:
            layer.use_plan(plan, for_tuning=True)  # forked where a graph captures it, as decode graphs run it
            layer.projection.prepare([m])
        states = [layer.new_state(m) for layer in self.layers]
        xs = [torch.randn(m, 1, g.hidden_size, device=self.device, dtype=torch.bfloat16) for _ in self.layers]
        c = len(self.layers)
        return graph_time_per_layer(lambda i: self.layers[i % c](xs[i % c], *states[i % c]), layers=LAYERS)

    def times(self, plans: dict[str, Plan], m: int, rounds: int) -> dict[str, list[float]]:
        """Microseconds per layer of the decode step under each of ``plans``, by name, timed in turn for ``rounds``
        rounds: plans compared under the same clocks."""
        found: dict[str, list[float]] = {name: [] for name in plans}
        for _ in range(rounds):
            for name, plan in plans.items():
                found[name].append(self.seconds_per_layer(plan, m) * 1e6)
        return found
