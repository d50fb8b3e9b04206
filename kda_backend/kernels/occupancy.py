"""Where a side GEMM's CTAs can land beside a one-wave main launch, from shared-memory occupancy.

Kimi-K3 TP8 QKVG's tuned CTAs (16 rows, 64 KB of shared memory) fit three to an SM, so on a 132-SM H200 its 384
CTAs leave 12 of 396 slots free, on SMs that then hold two QKVG CTAs. A side-chain CTA small enough to fit beside
three QKVG CTAs may land on any SM, and slows the QKVG CTAs it shares an SM with; the stage ends with its slowest
QKVG CTA. A CTA too large for that lands only in a free slot. Measured on H200 (benchmarks/RESULTS.md, levers):
beside 16-row QKVG CTAs, F_A/beta as 12 CTAs of 48 rows and 66 KB makes the overlapped stage 0.5-0.8 us faster at
M = 16 than 126 split-K CTAs of 17-25 KB, although it takes twice as long alone.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from kda_backend.kernels.skinny_gemm import (
    Tactic,
    block_t_for,
    fills_its_ring,
    padded_rows,
    row_blocks,
    validate_tactic,
)

SMEM_RESERVED_PER_CTA = 1024  # shared memory the driver keeps per resident CTA (SM 8.0 and later)
MAX_CTAS_PER_SM = 32
MAX_THREADS_PER_SM = 2048
SIDE_BLOCK_NS = (16, 32, 48, 64)
SIDE_BLOCK_K = 128
# The smallest ring depths that fit only in a free slot: 2-4 stages of 48-row CTAs on H200, where 4 was fastest (5 was
# slower, 3 lost 1.1 us at M = 16).
SIDE_STAGE_COUNTS = 3
X_PATHS = ({"x_via_l1": False}, {"x_via_l1": True}, {"x_via_l1": False, "x_tma": True})


@dataclasses.dataclass(frozen=True)
class SmBudget:
    """What each SM of a device offers resident CTAs: ``sms`` SMs of ``smem_per_sm`` bytes of shared memory."""

    sms: int
    smem_per_sm: int

    @classmethod
    def of(cls, device: torch.device) -> SmBudget:
        props = torch.cuda.get_device_properties(device)
        return cls(props.multi_processor_count, props.shared_memory_per_multiprocessor)

    def resident(self, tactic: Tactic) -> int:
        """CTAs of ``tactic`` one SM holds at once."""
        by_smem = self.smem_per_sm // (tactic.smem_bytes() + SMEM_RESERVED_PER_CTA)
        return min(by_smem, MAX_CTAS_PER_SM, MAX_THREADS_PER_SM // tactic.threads)

    def room_beside(self, tactic: Tactic, ctas: int) -> int:
        """Shared-memory bytes an SM holding ``ctas`` CTAs of ``tactic`` has left for another CTA (its reserve
        included)."""
        return self.smem_per_sm - ctas * (tactic.smem_bytes() + SMEM_RESERVED_PER_CTA)


def spare_slots(main: Tactic, main_ctas: int, budget: SmBudget) -> int:
    """CTA slots ``main_ctas`` CTAs of ``main`` leave free when they all fit at once, else 0: beside a launch of
    several waves, a CTA that fits only in a free slot would wait for its last wave."""
    return max(budget.sms * budget.resident(main) - main_ctas, 0)


def spare_slot_tactics(
    n: int, k: int, m: int, x_row_stride: int, main: Tactic, main_ctas: int, budget: SmBudget
) -> list[Tactic]:
    """Tactics for a GEMM ``[M, K] x [N, K]^T`` that runs beside ``main_ctas`` CTAs of ``main`` in their free
    slots only: as many CTAs as there are free slots at most (the most of any row-block x split-K layout), each too
    large for an SM full of ``main``'s CTAs but not for one missing a CTA; the smallest such ring depths that the
    CTA's K-tiles fill (:func:`~kda_backend.kernels.skinny_gemm.fills_its_ring`: F_B's one K-tile takes 2 slots,
    not a deeper ring as padding), each with activations from L2, through L1 and by TMA. Empty when ``main`` leaves
    no slot free or nothing fits."""
    spare = spare_slots(main, main_ctas, budget)
    if spare == 0 or k % SIDE_BLOCK_K:
        return []
    k_tiles = k // SIDE_BLOCK_K
    layouts = {  # (block_n, split_k) -> CTAs
        (block_n, split_k): row_blocks(n, block_n) * split_k
        for block_n in SIDE_BLOCK_NS if padded_rows(n) % block_n == 0
        for split_k in range(1, k_tiles + 1) if k_tiles % split_k == 0 and row_blocks(n, block_n) * split_k <= spare
    }
    if not layouts:
        return []
    most = max(layouts.values())
    per_sm, block_t = budget.resident(main), block_t_for(m)
    beside_full, in_free_slot = budget.room_beside(main, per_sm), budget.room_beside(main, per_sm - 1)

    def only_in_free_slot(tactic: Tactic) -> bool:
        return beside_full < tactic.smem_bytes() + SMEM_RESERVED_PER_CTA <= in_free_slot

    found = []
    for (block_n, split_k), ctas in layouts.items():
        if ctas != most:
            continue
        depths = [
            stages for stages in range(2, 16)
            if only_in_free_slot(probe := Tactic(block_n, SIDE_BLOCK_K, block_t, stages, split_k=split_k))
            and fills_its_ring(probe, k)
        ][:SIDE_STAGE_COUNTS]
        for stages, x_path in itertools.product(depths, X_PATHS):
            tactic = Tactic(block_n, SIDE_BLOCK_K, block_t, stages, split_k=split_k, **x_path)
            if only_in_free_slot(tactic) and validate_tactic(tactic, n, k, x_row_stride) is None:
                found.append(tactic)
    return found
