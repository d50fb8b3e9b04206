"""The CuTe provider's two kernel families behind one interface: which family serves a GEMM at an M, the token
buckets plans tune tactics for, and validation of either family's tactic.

- :class:`~kda_backend.kernels.skinny_gemm.Tactic`: the ``mma.sync`` kernel, every role, SM 9.x and 10.x, up to
  :data:`SKINNY_MAX_M` tokens (F_B up to :data:`WGMMA_MAX_M` with a tuned tactic, :data:`LARGE_M_SKINNY_ROLES`). At
  M <= 16 it streams QKVG at 96-99 % of copy bandwidth on H200.
- :class:`~kda_backend.kernels.wgmma_gemm.WgmmaTactic`: the warpgroup-MMA kernel, QKVG on SM 9.x, up to
  :data:`WGMMA_MAX_M` tokens. Where M grows past a few tens of tokens the ``mma.sync`` kernel's register-fed MMAs
  fall behind the weight stream (42 % of copy bandwidth at M = 64 on H200), which ``wgmma`` avoids.

Tactics are tuned per bucket of M (:func:`tactic_bucket`); a ``wgmma`` tactic tuned for a bucket runs every M in it
with the token tile covering that M (:func:`for_m`), since a smaller tile reads fewer activation bytes per K-tile.
An untuned QKVG call gets the ``wgmma`` default from 33 to 64 tokens; above 64 only a tuned ``wgmma`` tactic serves
(:func:`why_not_for`), else cuBLAS does.
"""

from __future__ import annotations

import dataclasses

from kda_backend.kernels.skinny_gemm import Tactic, default_tactic, validate_tactic
from kda_backend.kernels.wgmma_gemm import (
    WgmmaTactic,
    default_wgmma_tactic,
    validate_wgmma_tactic,
)

AnyTactic = Tactic | WgmmaTactic
SINGLE_TOKEN_BUCKET = 1
BUCKETS = (SINGLE_TOKEN_BUCKET, 16, 32, 64, 128, 256)
SKINNY_MAX_M = 64
WGMMA_MAX_M = 256
WGMMA_ROLES = ("qkvg",)  # F_A/beta and F_B are skinny: the split-K mma.sync kernel serves them beside QKVG
# Side-chain roles the mma.sync kernel also serves above SKINNY_MAX_M (64-token tiles along grid y), with a tactic a
# plan tuned there: F_B after QKVG in a sequential step, where cuBLAS's launch costs more than F_B's 0.4 MB of
# weights. F_A/beta is not among them: its 144 rows on few CTAs took 16.6 / 18.1 us at M = 96 / 128 alone on H200.
LARGE_M_SKINNY_ROLES = ("fb",)
WGMMA_MAJORS = (9,)
# Above this M an untuned QKVG call on SM 9.x gets the wgmma kernel's default (measured on H200, Kimi-K3 TP8 QKVG
# alone: at M = 24..32 mma.sync streams at 87-89 % of copy bandwidth and wgmma at 91-92 %, at M = 64 42 % against
# 84 %).
WGMMA_DEFAULT_ABOVE_M = 32


def tactic_bucket(m: int) -> int:
    """Key of the tuned tactics serving ``m`` tokens: the smallest of :data:`BUCKETS` covering ``m``, except that
    a single token has its own (activations by bulk copy win there and lose from two tokens on, see
    :attr:`Tactic.x_bulk`). A table without the single-token bucket serves one token from the 16-token bucket."""
    return SINGLE_TOKEN_BUCKET if m == 1 else next((b for b in BUCKETS[1:] if m <= b), BUCKETS[-1])


def wgmma_serves(role: str, capability: tuple[int, int] | None) -> bool:
    """Whether the ``wgmma`` family can serve ``role`` on a device of ``capability``."""
    return role in WGMMA_ROLES and capability is not None and capability[0] in WGMMA_MAJORS


def max_m(role: str, capability: tuple[int, int] | None) -> int:
    """The most tokens a CuTe kernel serves for ``role`` on ``capability``."""
    return WGMMA_MAX_M if wgmma_serves(role, capability) or role in LARGE_M_SKINNY_ROLES else SKINNY_MAX_M


def for_m(tactic: AnyTactic, m: int) -> AnyTactic:
    """``tactic`` as it runs ``m`` tokens: a ``wgmma`` tactic with the token tile covering ``m``."""
    return tactic.for_tokens(m) if isinstance(tactic, WgmmaTactic) else tactic


def default_for(role: str, n: int, k: int, m: int, capability: tuple[int, int] | None) -> AnyTactic:
    """The tactic an untuned call runs: ``wgmma``'s default above :data:`WGMMA_DEFAULT_ABOVE_M` where it serves,
    else the ``mma.sync`` kernel's."""
    if m > WGMMA_DEFAULT_ABOVE_M and wgmma_serves(role, capability):
        return default_wgmma_tactic(n, k, m)
    return default_tactic(n, k, m)


def validate_any(tactic: AnyTactic, n: int, k: int, x_row_stride: int) -> str | None:
    """``None`` if ``tactic`` (either family) can run a GEMM with these static sizes, else why not."""
    # Sizes, depths and splits are all counts: a zero would reach the families' divisibility checks (plan files).
    for field in dataclasses.fields(tactic):
        value = getattr(tactic, field.name)
        if type(value) is int and value < 1:
            return f"{field.name}={value} must be a positive integer"
    if isinstance(tactic, WgmmaTactic):
        return validate_wgmma_tactic(tactic, n, k, x_row_stride)
    return validate_tactic(tactic, n, k, x_row_stride)


def why_not_for(tactic: AnyTactic, role: str, m: int, capability: tuple[int, int] | None, tuned: bool) -> str | None:
    """Why ``tactic``'s family cannot serve ``role`` at ``m`` tokens on ``capability``, or ``None``. Above
    :data:`SKINNY_MAX_M` the wgmma kernel serves only a tactic a plan tuned there: measured on H200 (Kimi-K3 QKVG
    alone, TP 8 and 4), its default was 5-23 % slower than cuBLAS at M = 96..256, so untuned calls go to cuBLAS.
    The mma.sync kernel serves :data:`LARGE_M_SKINNY_ROLES` there likewise, the other roles not at all."""
    if isinstance(tactic, WgmmaTactic):
        if not wgmma_serves(role, capability):
            return f"the wgmma kernel serves {', '.join(WGMMA_ROLES)} on SM {WGMMA_MAJORS}, not {role} on {capability}"
        if m > WGMMA_MAX_M:
            return f"M > {WGMMA_MAX_M}"
        return f"M > {SKINNY_MAX_M} without a tuned wgmma tactic" if m > SKINNY_MAX_M and not tuned else None
    if m > SKINNY_MAX_M and not (tuned and role in LARGE_M_SKINNY_ROLES):
        return f"M > {SKINNY_MAX_M}" + (" without a tuned tactic" if role in LARGE_M_SKINNY_ROLES else "")
    return None
