"""Experiment (twelfth session): does marking activations evict-last in L2 slow the rest of the decode step?
Times one KimiK3DeltaAttention decode step (bench's _layer_decode_time) and the projection stage alone, with the
plan forced to overlap on CuTe kernels (default tactics). Variant from argv[1]."""
import sys

import torch

from kda_backend.autotune import make_weight_copies
from kda_backend.bench import _layer_decode_time, _stage_time
from kda_backend.geometry import preset
from kda_backend.planning import resolve_plan

g = preset("kimi-k3", 8)
dev = torch.device("cuda")
plan = resolve_plan(g, dev)
weights = make_weight_copies(g, dev)
for m in (1, 4, 16):
    step = _layer_decode_time(g, plan, m, dev) * 1e6
    stage = _stage_time(weights, plan, m) * 1e6
    print(f"{sys.argv[1]:6} M={m:2} decode step {step:6.2f} us  stage {stage:6.2f} us  rest {step - stage:6.2f} us", flush=True)
