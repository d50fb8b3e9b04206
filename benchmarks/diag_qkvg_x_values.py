"""Diagnostic: does QKVG's slowdown from M = 1 to M = 16 follow the token count or the activation values?
Times the default QKVG tactic alone at M = 1 and 16 with random activations, at M = 16 with all but the first
token zero and with all tokens zero, and the SM clock / power the driver reports meanwhile.

Usage (GPU machine): python benchmarks/diag_qkvg_x_values.py
"""

import subprocess

import torch

from kda_backend.autotune import make_weight_copies
from kda_backend.geometry import preset
from kda_backend.kernels.skinny_gemm import default_tactic
from kda_backend.providers.cute_provider import launch
from kda_backend.timing import graph_time_per_layer


def activations(m: int, live_tokens: int) -> list[torch.Tensor]:
    """One x per weight copy; tokens at or past ``live_tokens`` are zero."""
    xs = [torch.randn(m, g.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in weights]
    for x in xs:
        x[live_tokens:] = 0
    return xs


def clocks() -> str:
    query = "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    return subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True,
                          check=False).stdout.strip()


g = preset("kimi-k3", 8)
weights = make_weight_copies(g, torch.device("cuda"))
for m, live in ((1, 1), (16, 16), (16, 1), (16, 0), (1, 1), (16, 16)):
    xs = activations(m, live)
    outs = [torch.empty(m, g.qkvg_rows, device="cuda", dtype=torch.bfloat16) for _ in weights]
    tactic = default_tactic(g.qkvg_rows, g.hidden_size, m)

    def layer(i, xs=xs, outs=outs, tactic=tactic):
        j = i % len(weights)
        launch(tactic, xs[j], weights[j].w_qkvg, outs[j])

    times = [graph_time_per_layer(layer, replays=400) * 1e6 for _ in range(3)]
    print(f"M={m:2} live tokens {live:2}: {' / '.join(f'{t:.2f}' for t in times)} us  [{clocks()}]", flush=True)
