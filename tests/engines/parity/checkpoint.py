"""Seeded synthetic Kimi-K3-style checkpoints (real per-layer parameter names) and fixed parity inputs.

One KDA layer (``model.layers.0.self_attn``) of an unsharded model with the given geometry, in safetensors, as an
HF checkpoint stores it; the engines load it through their own weight loaders, as tensor-parallel rank ``r`` of
``tp`` for every case in :data:`PARITY_CASES`.

Two geometries: ``tiny`` (hidden 256, 8 heads of 32) is sharded over TP 1, 2, 4 and 8; ``k3-rank`` (hidden 7168,
12 heads of 128) at TP 1 has exactly the per-rank shapes of Kimi-K3 at TP 8 (QKVG 6144 x 7168, F_A/beta 140 rows
used, F_B 1536 x 128) without writing the 0.7 GB of a whole K3 layer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kda_backend.geometry import KDAGeometry

PREFIX = "model.layers.0.self_attn"
TINY = KDAGeometry(hidden_size=256, num_heads=8, head_dim=32, tp_size=1)
K3_RANK = KDAGeometry(hidden_size=7168, num_heads=12, head_dim=128, tp_size=1)
CHECKPOINTS = {"tiny": TINY, "k3-rank": K3_RANK}
TP_SIZES = {"tiny": (1, 2, 4, 8), "k3-rank": (1,)}
# (checkpoint, tp, rank): every shard each engine loads and projects.
PARITY_CASES = tuple((name, tp, rank) for name in CHECKPOINTS for tp in TP_SIZES[name] for rank in range(tp))
PARITY_MS = tuple(range(1, 17))
NAMES = ("qkvg", "g1", "beta")


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


def rank_shards(tensors: dict[str, torch.Tensor], geometry: KDAGeometry, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of ``tp`` must hold, sliced here independently of any engine: q, k, v, g, b and f_b
    sharded by heads, f_a replicated."""
    g = geometry.with_tp(tp)
    hd, h = g.local_width, g.heads_local

    def rows(name, width):
        return tensors[f"{PREFIX}.{name}.weight"][rank * width : (rank + 1) * width]

    shards = {n: rows(f"{n}_proj", hd) for n in "qkvg"}
    shards |= {"f_a": tensors[f"{PREFIX}.f_a_proj.weight"], "b": rows("b_proj", h), "f_b": rows("f_b_proj", hd)}
    return shards


def core_weights(shards: dict[str, torch.Tensor], geometry: KDAGeometry, packed: bool, row_multiple: int):
    """:class:`ProjectionWeights` over one rank's shards: packed ``[QKVG; FAB]`` as vLLM stores it, or split with
    F_A/beta padded to ``row_multiple`` rows as SGLang merges it."""
    from kda_backend import ProjectionWeights

    g = dataclasses.replace(geometry, row_multiple=row_multiple)
    w_qkvg = torch.cat([shards[n] for n in "qkvg"])
    fab_used = torch.cat([shards["f_a"], shards["b"]])
    w_fab = torch.cat([fab_used, fab_used.new_zeros(g.fab_rows - g.fab_rows_used, g.hidden_size)])
    if packed:
        return ProjectionWeights.from_packed(torch.cat([w_qkvg, w_fab]), shards["f_b"], g)
    return ProjectionWeights.from_split(w_qkvg, w_fab, shards["f_b"], g)


def loaded_checksums(weights) -> dict[str, list[float]]:
    """Checksums of what a projection's weight views hold (padding rows excluded)."""
    g = weights.geometry
    return checksums({
        "qkvg": weights.w_qkvg, "f_a": weights.w_fab[: g.head_dim], "b": weights.w_fab[g.head_dim : g.fab_rows_used],
        "fb": weights.w_fb,
    })


def parity_input(m: int, hidden: int) -> torch.Tensor:
    """The fixed activations every path projects for token count ``m``."""
    return (torch.randn(m, hidden, generator=torch.Generator().manual_seed(1000 + m))).bfloat16()


def artifacts_dir() -> Path:
    """Where each engine's nox session writes its outputs for the final comparison (ignored by git)."""
    return Path(__file__).resolve().parents[3] / ".parity-artifacts"


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """Order-independent fingerprints of loaded weights (float64 sums of values and squares)."""
    return {k: [float(t.double().sum()), float(t.double().pow(2).sum())] for k, t in tensors.items()}
