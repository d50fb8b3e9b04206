"""Per-rank shapes of one KDA layer, derived from the model geometry and the tensor-parallel size.

Every shape the backend uses comes from :class:`KDAGeometry`; no other module hard-codes a Kimi-K3 number.

Row layouts (weights are ``[out_features, in_features]``, bf16):

- QKVG ``[4 * heads_local * head_dim, hidden]``: q | k | v | g, each ``heads_local * head_dim`` rows.
- FAB ``[fab_rows, hidden]``: f_a (``head_dim`` rows, replicated on every rank) | beta (``heads_local`` rows)
  | zero pad up to a multiple of ``row_multiple`` (so packed GEMMs see aligned row counts).
- F_B ``[heads_local * head_dim, head_dim]``: maps f_a's output to the per-channel decay gate.
- packed ``[qkvg_rows + fab_rows, hidden]``: QKVG stacked on FAB, the layout vLLM stores as ``in_proj_qkvgfab``.
"""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class KDAGeometry:
    """Model-level KDA geometry plus the tensor-parallel size; properties give the per-rank shapes (computed once:
    the projection reads them on every call).

    :param hidden_size: model width (the GEMMs' K).
    :param num_heads: KDA heads over all ranks.
    :param head_dim: per-head key/value width (K = V).
    :param tp_size: tensor-parallel ranks; must divide ``num_heads``.
    :param conv_width: short causal convolution width.
    :param row_multiple: FAB rows are zero-padded up to a multiple of this.
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    tp_size: int = 1
    conv_width: int = 4
    row_multiple: int = 16

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "tp_size", "conv_width", "row_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KDAGeometry.{name}: {value!r} ({type(value).__name__}); accepted: a positive int")
        if self.num_heads % self.tp_size:
            raise ValueError(
                f"tp_size={self.tp_size} does not divide num_heads={self.num_heads}; "
                f"valid tp sizes: {valid_tp_sizes(self.num_heads)}"
            )

    def with_tp(self, tp_size: int) -> KDAGeometry:
        """The same model sharded over ``tp_size`` ranks."""
        return dataclasses.replace(self, tp_size=tp_size)

    @functools.cached_property
    def heads_local(self) -> int:
        return self.num_heads // self.tp_size

    @functools.cached_property
    def local_width(self) -> int:
        """``heads_local * head_dim``: width of each of q, k, v, g and of F_B's output."""
        return self.heads_local * self.head_dim

    @functools.cached_property
    def qkvg_rows(self) -> int:
        return 4 * self.local_width

    @functools.cached_property
    def fab_rows_used(self) -> int:
        """f_a rows + beta rows, before padding."""
        return self.head_dim + self.heads_local

    @functools.cached_property
    def fab_rows(self) -> int:
        return -(-self.fab_rows_used // self.row_multiple) * self.row_multiple

    @functools.cached_property
    def packed_rows(self) -> int:
        return self.qkvg_rows + self.fab_rows

    @property
    def fb_shape(self) -> tuple[int, int]:
        """F_B weight shape ``(heads_local * head_dim, head_dim)``."""
        return (self.local_width, self.head_dim)

    @property
    def conv_channels(self) -> int:
        """Channels of the short conv (q, k and v): ``3 * heads_local * head_dim``."""
        return 3 * self.local_width

    def weight_bytes(self, element_size: int = 2) -> int:
        """Bytes one rank's projection stage reads from its weights (QKVG + FAB + F_B)."""
        n_elems = self.packed_rows * self.hidden_size + self.local_width * self.head_dim
        return n_elems * element_size

    def stage_flops(self, m: int) -> int:
        """Floating-point operations of one rank's projection stage at ``m`` tokens (QKVG, F_A/beta and F_B)."""
        return 2 * m * (self.packed_rows * self.hidden_size + self.local_width * self.head_dim)

    def describe(self) -> dict[str, object]:
        """Per-rank shapes as plain data (for the CLI, plans and logs)."""
        return {
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "tp_size": self.tp_size,
            "heads_local": self.heads_local,
            "qkvg": [self.qkvg_rows, self.hidden_size],
            "fab": [self.fab_rows, self.hidden_size],
            "fb": list(self.fb_shape),
            "packed": [self.packed_rows, self.hidden_size],
            "conv_width": self.conv_width,
        }


def valid_tp_sizes(num_heads: int) -> list[int]:
    """Tensor-parallel sizes that divide ``num_heads``."""
    return [t for t in range(1, num_heads + 1) if num_heads % t == 0]


PRESETS: dict[str, KDAGeometry] = {
    # Kimi-K3: hidden 7168, 96 KDA heads of dim 128, short conv width 4.
    "kimi-k3": KDAGeometry(hidden_size=7168, num_heads=96, head_dim=128, conv_width=4),
}


def preset(name: str, tp_size: int = 1) -> KDAGeometry:
    """A named model geometry sharded over ``tp_size`` ranks."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown geometry preset {name!r}; known: {sorted(PRESETS)}") from None
    return base.with_tp(tp_size)
