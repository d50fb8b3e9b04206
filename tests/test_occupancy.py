"""Spare-slot side-chain tactics: occupancy arithmetic, the candidates it yields, and the autotuner timing them."""

import types

import pytest
import torch

from kda_backend import autotune
from kda_backend.geometry import preset
from kda_backend.kernels.compile_cache import KernelKey, compile_gemm
from kda_backend.kernels.occupancy import (
    SMEM_RESERVED_PER_CTA,
    SmBudget,
    spare_slot_tactics,
    spare_slots,
)
from kda_backend.kernels.skinny_gemm import Tactic, validate_tactic
from kda_backend.kernels.wgmma_gemm import WgmmaTactic, leaves_room

H200 = SmBudget(sms=132, smem_per_sm=228 * 1024)
QKVG_TUNED = Tactic(16, 256, 16, 4)  # 64.5 KB: three per SM
TP8 = preset("kimi-k3", 8)
QKVG_CTAS = TP8.qkvg_rows // 16  # 384, one wave


def test_qkvg_leaves_twelve_slots_on_h200():
    assert H200.resident(QKVG_TUNED) == 3
    assert spare_slots(QKVG_TUNED, QKVG_CTAS, H200) == 12
    assert spare_slots(QKVG_TUNED, 2 * QKVG_CTAS, H200) == 0  # two waves: nothing is free while the first runs
    assert H200.resident(Tactic(16, 256, 16, 6)) == 2


def test_f_a_beta_candidates_fill_the_free_slots_and_nothing_else():
    n, k = TP8.fab_rows, TP8.hidden_size
    found = spare_slot_tactics(n, k, 16, k, QKVG_TUNED, QKVG_CTAS, H200)
    beside_full, in_free_slot = H200.room_beside(QKVG_TUNED, 3), H200.room_beside(QKVG_TUNED, 2)
    assert found and len(set(found)) == len(found)
    for t in found:
        assert validate_tactic(t, n, k, k) is None
        assert n // t.block_n * t.split_k == 12  # one CTA per free slot
        assert beside_full < t.smem_bytes() + SMEM_RESERVED_PER_CTA <= in_free_slot
    assert {(t.x_via_l1, t.x_tma) for t in found} == {(False, False), (True, False), (False, True)}
    assert Tactic(48, 128, 16, 4, split_k=4, x_via_l1=False) in found  # fastest in the stage on H200
    wide_tokens = spare_slot_tactics(n, k, 40, k, QKVG_TUNED, QKVG_CTAS, H200)
    assert wide_tokens and all(t.block_t == 64 for t in wide_tokens)


def test_spare_slot_rings_are_filled_by_their_k_tiles():
    """Beside 128 tokens-on-M QKVG CTAs (one per SM) F_B's one K-tile gets 2-slot rings only, where a deeper ring
    would be padding; F_A/beta's 14-way split (4 K-tiles per CTA) keeps its 2-4 slot rings."""
    qkvg = WgmmaTactic(48, 64, 64, 8, tokens_on_m=True, pdl=True).for_tokens(64)
    ctas = qkvg.ctas(TP8.qkvg_rows, 64)
    fb = spare_slot_tactics(TP8.local_width, TP8.head_dim, 64, TP8.fab_rows, qkvg, ctas, H200)
    assert fb and {t.stages for t in fb} == {2}
    fab = spare_slot_tactics(TP8.fab_rows, TP8.hidden_size, 64, TP8.hidden_size, qkvg, ctas, H200)
    assert {(t.stages, t.split_k) for t in fab} == {(2, 14), (3, 14), (4, 14)}


@pytest.mark.parametrize(
    "n,k,main_ctas,why",
    [
        (TP8.fab_rows, TP8.hidden_size, 2 * QKVG_CTAS, "main launch of two waves"),
        (TP8.fab_rows, TP8.hidden_size, 396, "main launch fills every slot"),
        (TP8.local_width, TP8.head_dim, QKVG_CTAS, "F_B needs more than 12 CTAs of at most 64 rows"),
        (TP8.fab_rows, 7104, QKVG_CTAS, "K not a multiple of 128"),
    ],
)
def test_no_candidates_where_no_free_slot_can_take_the_gemm(n, k, main_ctas, why):
    assert spare_slot_tactics(n, k, 16, k, QKVG_TUNED, main_ctas, H200) == [], why


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_spare_slot_tactics_compile_on_cpu(arch):
    n, k = TP8.fab_rows, TP8.hidden_size
    for tactic in (Tactic(48, 128, 16, 4, split_k=4, x_via_l1=False), Tactic(48, 128, 16, 3, split_k=4, x_tma=True,
                                                                            x_via_l1=False)):
        assert compile_gemm(KernelKey(tactic, n, k, k, k, arch)) is not None


FAB_KEY = ("fab", TP8.fab_rows, TP8.hidden_size, 16)
QKVG_KEY = ("qkvg", TP8.qkvg_rows, TP8.hidden_size, 16)
WINNER = Tactic(48, 128, 16, 4, split_k=4, x_via_l1=False)
SPLIT_DEFAULT = Tactic(16, 128, 16, 3, split_k=14)  # F_A/beta's default: the fastest alone when all tie


def _tune_with_stubbed_timings(monkeypatch, stage_time, wrong=lambda role, tactic: False, progress=None,
                               time_trailing=lambda weights, m, tactics: None):
    """``tune_tactics`` for TP8's 16-token bucket on a simulated H200: every GEMM alone takes 1 us (2 us for
    48-row CTAs), and the stage ``stage_time(QKVG tactic, F_A/beta tactic, m, how many times that pair was timed
    at m)`` seconds (without a fork: ``time_trailing``, by default no such form); the tactics ``wrong(role,
    tactic)`` names compute wrongly. Returns the table and the (QKVG, F_A/beta) tactics of each stage timing;
    ``progress`` collects the tuner's lines."""
    staged, timed = [], []

    def time_step(weights, step, m, tactics):
        pair = (tactics.get(QKVG_KEY), tactics[FAB_KEY])
        staged.append((pair, m))
        return stage_time(*pair, m, staged.count((pair, m)))

    def time_tactic(weights, role, tactic, m):
        timed.append((role, tactic))
        return 2e-6 if tactic.block_n == 48 else 1e-6

    monkeypatch.setattr(autotune, "time_tactic", time_tactic)
    monkeypatch.setattr(autotune, "time_step", time_step)
    monkeypatch.setattr(autotune, "time_trailing", time_trailing)
    monkeypatch.setattr(autotune, "tactic_error",
                        lambda weights, role, tactic, m: "relative error 0.5 > 0.01" if wrong(role, tactic) else None)
    monkeypatch.setattr(SmBudget, "of", classmethod(lambda cls, device: H200))
    weights = [types.SimpleNamespace(geometry=TP8, device=torch.device("cpu"))]
    table = autotune.tune_tactics(TP8, weights, [16], progress=(progress if progress is not None else []).append)
    assert not any(wrong(role, tactic) for role, tactic in timed)
    assert not any(wrong("qkvg", q) or wrong("fab", f) for (q, f), _ in staged)
    return table, [pair for pair, _ in staged]


def test_tactics_that_compute_wrongly_are_never_timed_or_kept(monkeypatch):
    """Every candidate is checked against fp32 before it is timed: one that computes wrongly on the device (here
    F_A/beta's split-K default and QKVG's 48-row CTAs) is reported and never timed, alone or in the stage; where
    no candidate of a role is right, tuning stops with an error naming the role."""
    lines = []

    def wrong(role, tactic):
        return (role, tactic) == ("fab", SPLIT_DEFAULT) or (role == "qkvg" and tactic.block_n == 48)

    table, _ = _tune_with_stubbed_timings(monkeypatch, lambda qkvg, fab, m, n: 1e-6, wrong=wrong, progress=lines)
    assert table[FAB_KEY] != SPLIT_DEFAULT and table[QKVG_KEY].block_n != 48
    assert f"tactic fab {SPLIT_DEFAULT.key()} dropped: relative error 0.5 > 0.01" in lines
    with pytest.raises(RuntimeError, match="no CuTe tactic for fb computed right at M = \\[2, 8, 16\\]"):
        _tune_with_stubbed_timings(monkeypatch, lambda qkvg, fab, m, n: 1e-6, wrong=lambda role, tactic: role == "fb")


def test_autotuner_times_spare_slot_tactics_in_the_stage(monkeypatch):
    """The in-stage pass for F_A/beta times the spare-slot candidates beside the QKVG tactic it chose, and keeps one
    where it makes the stage fastest though it is not the fastest alone."""
    table, staged = _tune_with_stubbed_timings(monkeypatch, lambda qkvg, fab, m, n: 0.9e-6 if fab == WINNER else 1e-6)
    qkvg = table[QKVG_KEY]
    spare = spare_slot_tactics(TP8.fab_rows, TP8.hidden_size, 16, TP8.hidden_size, qkvg, QKVG_CTAS, H200)
    assert qkvg == QKVG_TUNED and WINNER in spare
    assert set(spare) <= {fab for q, fab in staged if q == qkvg}
    assert table[FAB_KEY] == WINNER


def test_qkvg_is_timed_beside_each_side_chain_that_suits_it(monkeypatch):
    """Each QKVG candidate is timed with pass 1's F_A/beta and with its own spare-slot partner, so either pairing
    can win: 48-row QKVG CTAs beside small split-K F_A/beta CTAs, or 16-row ones beside the free-slot F_A/beta
    (on H200, which one was faster differed between machines)."""
    tall = Tactic(48, 256, 16, 4, x_via_l1=False)
    assert autotune.spare_slot_partner(
        spare_slot_tactics(TP8.fab_rows, TP8.hidden_size, 16, TP8.hidden_size, QKVG_TUNED, QKVG_CTAS, H200)
    ) == WINNER

    def stage_times(best: tuple, runner_up: tuple):
        return lambda qkvg, fab, m, times_timed: {best: 0.8e-6, runner_up: 0.9e-6}.get((qkvg, fab), 1e-6)

    pairings = ((tall, SPLIT_DEFAULT), (QKVG_TUNED, WINNER))
    for best, runner_up in (pairings, pairings[::-1]):
        table, staged = _tune_with_stubbed_timings(monkeypatch, stage_times(best, runner_up))
        assert {(QKVG_TUNED, WINNER), (QKVG_TUNED, SPLIT_DEFAULT), (tall, SPLIT_DEFAULT)} <= set(staged)
        assert (table[QKVG_KEY], table[FAB_KEY]) == best


def test_a_lucky_first_stage_timing_does_not_decide(monkeypatch):
    """Candidates are timed once each, the best few again in turn, and judged by their medians: a spare-slot
    F_A/beta that timed 0.85 us once and 1 us after loses to one that times 0.9 us every time."""
    lucky = Tactic(48, 128, 16, 4, split_k=4, x_via_l1=True)  # timed in the side chain's pass only

    def stage_time(qkvg, fab, m, times_timed):
        if fab == WINNER:
            return 0.9e-6
        return 0.85e-6 if fab == lucky and times_timed == 1 else 1e-6

    table, staged = _tune_with_stubbed_timings(monkeypatch, stage_time)
    assert table[FAB_KEY] == WINNER
    # Timed at three M, then again as a finalist.
    assert staged.count((table[QKVG_KEY], lucky)) == 3 * (1 + autotune.RETIMING_ROUNDS)


def test_wgmma_qkvg_is_tuned_alone_above_64_tokens_and_in_the_stage_below(monkeypatch):
    """On SM 9.x the wgmma QKVG candidates are timed alone; above 64 tokens (no CuTe F_A/beta) the fastest alone
    is kept, for QKVG and for one GEMM over the packed weight, and F_B's mma.sync tactic alone; at 32 tokens the
    finalists (the fastest alone, and the fastest whose ring leaves the side chain room) are timed in the overlapped
    stage beside F_A/beta with the mma.sync ones."""
    staged = []

    def time_step(weights, step, m, tactics):
        staged.append(tactics.get(("qkvg", TP8.qkvg_rows, TP8.hidden_size, 32)))
        return 0.5e-6 if isinstance(staged[-1], WgmmaTactic) and not staged[-1].pdl else 1e-6

    def time_tactic(weights, role, tactic, m):
        return 0.8e-6 if isinstance(tactic, WgmmaTactic) and tactic.block_n == 128 else 1e-6

    monkeypatch.setattr(autotune, "time_tactic", time_tactic)
    monkeypatch.setattr(autotune, "time_step", time_step)
    monkeypatch.setattr(autotune, "time_trailing", lambda weights, m, tactics: None)
    monkeypatch.setattr(autotune, "tactic_error", lambda weights, role, tactic, m: None)
    monkeypatch.setattr(autotune, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(SmBudget, "of", classmethod(lambda cls, device: H200))
    weights = [types.SimpleNamespace(geometry=TP8, device=torch.device("cpu"), packed=object())]
    table = autotune.tune_tactics(TP8, weights, [32, 128])
    large = table[("qkvg", TP8.qkvg_rows, TP8.hidden_size, 128)]
    assert isinstance(large, WgmmaTactic) and large.block_n == 128 and large.block_t == 128
    # Above 64 tokens also one GEMM over the packed weight (a sequential step's packed form), below it none.
    packed = table[("qkvg", TP8.packed_rows, TP8.hidden_size, 128)]
    assert isinstance(packed, WgmmaTactic) and packed.block_n == 128
    assert ("qkvg", TP8.packed_rows, TP8.hidden_size, 32) not in table
    assert ("fab", TP8.fab_rows, TP8.hidden_size, 128) not in table  # F_A/beta is not CuTe's above 64
    assert isinstance(table[("fb", TP8.local_width, TP8.head_dim, 128)], Tactic)  # F_B is, timed alone
    in_stage = {t for t in staged if isinstance(t, WgmmaTactic)}
    fastest = {t for t in in_stage if t.block_n == 128}
    assert len(fastest) == autotune.WGMMA_FINALISTS and not any(leaves_room(t) for t in fastest)
    roomy = in_stage - fastest
    assert len(roomy) == 1 and leaves_room(roomy.pop())
    chosen = table[("qkvg", TP8.qkvg_rows, TP8.hidden_size, 32)]
    assert isinstance(chosen, WgmmaTactic) and not chosen.pdl


FB_KEY = ("fb", TP8.local_width, TP8.head_dim, 16)
FB_TACTICS = [Tactic(16, 128, 16, 2, x_via_l1=False, x_tma=True), Tactic(16, 128, 16, 2, x_via_l1=False),
              Tactic(16, 128, 16, 2, x_via_l1=True)]


def _side_chain_choice(monkeypatch, forked, trailing, break_ties=True):
    """``_best_in_stage`` over :data:`FB_TACTICS` for F_B at TP8's 16-token bucket, with the forked stage taking
    ``forked[i]`` us for candidate i at every M and the stage without a fork ``trailing(i)`` us (``None``: no such
    form; an exception: timing it fails). Returns the chosen tactic and the tuner's lines."""
    index = {t: i for i, t in enumerate(FB_TACTICS)}
    monkeypatch.setattr(autotune, "time_step", lambda weights, step, m, tactics: forked[index[tactics[FB_KEY]]] * 1e-6)

    def time_trailing(weights, m, tactics):
        value = trailing(index[tactics[FB_KEY]])
        return None if value is None else value * 1e-6

    monkeypatch.setattr(autotune, "time_trailing", time_trailing)
    lines = []
    chosen = autotune._best_in_stage([], 16, {}, [{FB_KEY: t} for t in FB_TACTICS], lines.append,
                                     break_ties_without_fork=break_ties)
    return chosen[FB_KEY], lines


def test_side_chain_ties_in_the_forked_stage_go_to_the_faster_stage_without_a_fork(monkeypatch):
    """Within 1 % of the fastest forked stage the stage without a fork decides (there a padded F_B ring cost 4 us on
    H200); a candidate outside the tie never wins on that form, however fast there."""
    forked, trailing = [24.00, 24.10, 26.00], [31.0, 27.0, 20.0]
    chosen, lines = _side_chain_choice(monkeypatch, forked, trailing.__getitem__)
    assert chosen == FB_TACTICS[1]
    assert any(line.startswith("t16 stage without a fork, among the tied: fb n16k128t16s2p ") for line in lines)
    assert _side_chain_choice(monkeypatch, forked, trailing.__getitem__, break_ties=False)[0] == FB_TACTICS[0]
    assert _side_chain_choice(monkeypatch, [24.0, 25.0, 26.0], trailing.__getitem__)[0] == FB_TACTICS[0]


def test_the_forked_choice_stands_where_the_stage_without_a_fork_is_not_timed(monkeypatch):
    """No such form for a candidate (the provider builds none), or a timing that fails: the fastest forked stage is
    kept, and a failure is reported."""
    forked = [24.0, 24.1, 24.1]
    no_form, _ = _side_chain_choice(monkeypatch, forked, lambda i: None if i == 2 else 30.0 - i)
    assert no_form == FB_TACTICS[0]

    def fails(i):
        raise RuntimeError("trailing kernel failed to compile")

    chosen, lines = _side_chain_choice(monkeypatch, forked, fails)
    assert chosen == FB_TACTICS[0]
    assert "t16 stage without a fork not timed (RuntimeError: trailing kernel failed to compile); keeping fb " \
        "n16k128t16s2pT" in lines


def test_the_side_chain_pass_breaks_ties_without_a_fork_and_the_qkvg_pass_does_not(monkeypatch):
    """In ``tune_tactics`` only the side chain's in-stage pass times candidates without a fork: QKVG's tactic is
    chosen for the forked stage, which full-graph decode runs."""
    seen = []

    def time_trailing(weights, m, tactics):
        seen.append((tactics[QKVG_KEY], tactics[FAB_KEY], tactics[FB_KEY]))
        return 1e-6

    table, _ = _tune_with_stubbed_timings(monkeypatch, lambda qkvg, fab, m, n: 1e-6, time_trailing=time_trailing)
    assert seen and {q for q, _, _ in seen} == {table[QKVG_KEY]}
    assert {f for _, f, _ in seen} > {table[FAB_KEY]}  # F_A/beta's tied candidates, F_B's pass with the one kept
