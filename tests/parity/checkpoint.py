"""Seeded synthetic Kimi-K3-style checkpoints (real per-layer parameter names) and fixed parity inputs.

One KDA layer (``model.layers.0.self_attn``) of an unsharded model with the given geometry, in safetensors, as an
HF checkpoint stores it; the engines load it through their own weight loaders.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kda_backend.geometry import KDAGeometry

PREFIX = "model.layers.0.self_attn"
TINY = KDAGeometry(hidden_size=256, num_heads=8, head_dim=32, tp_size=1)
PARITY_MS = tuple(range(1, 17))


def make_checkpoint(path: Path, geometry: KDAGeometry = TINY, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write and return the layer's tensors (bf16 projections, fp32 A_log / dt_bias / conv / norm)."""
    g = geometry.with_tp(1)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    hd, h, d, hid = g.local_width, g.heads_local, g.head_dim, g.hidden_size
    tensors = {f"{PREFIX}.{name}_proj.weight": rnd(hd, hid, scale=hid**-0.5) for name in ("q", "k", "v", "g")}
    tensors |= {
        f"{PREFIX}.f_a_proj.weight": rnd(d, hid, scale=hid**-0.5),
        f"{PREFIX}.b_proj.weight": rnd(h, hid, scale=hid**-0.5),
        f"{PREFIX}.f_b_proj.weight": rnd(hd, d, scale=d**-0.5),
        f"{PREFIX}.o_proj.weight": rnd(hid, hd, scale=hd**-0.5),
        f"{PREFIX}.A_log": rnd(h, dtype=torch.float32),
        f"{PREFIX}.dt_bias": rnd(hd, dtype=torch.float32),
        f"{PREFIX}.o_norm.weight": 1 + rnd(d, scale=0.1, dtype=torch.float32),
    }
    tensors |= {f"{PREFIX}.{n}_conv1d.weight": rnd(hd, 1, g.conv_width, dtype=torch.float32) for n in "qkv"}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return tensors


def load_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def parity_input(m: int, hidden: int) -> torch.Tensor:
    """The fixed activations every path projects for token count ``m``."""
    return (torch.randn(m, hidden, generator=torch.Generator().manual_seed(1000 + m))).bfloat16()


def artifacts_dir() -> Path:
    """Where each engine session writes its outputs for the final comparison (ignored by git)."""
    return Path(__file__).resolve().parents[2] / ".parity-artifacts"


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """Order-independent fingerprints of loaded weights (float64 sums of values and squares)."""
    return {k: [float(t.double().sum()), float(t.double().pow(2).sum())] for k, t in tensors.items()}
