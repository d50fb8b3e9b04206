"""Bookkeeping of the split-K and chain counters that runs without a GPU (the kernel side is in test_gpu_kernels)."""

import dataclasses

import pytest
import torch

from kda_backend.kernels import arrival_counters as ac


@dataclasses.dataclass(frozen=True)
class FakeStream:
    device_index: int
    cuda_stream: int


@pytest.fixture
def counters():
    """A fresh registry whose per-device arena is a CPU tensor (as if ``reserve`` had run on a GPU)."""
    registry = ac.ArrivalCounters()
    registry._arenas[0] = torch.zeros(ac.STREAMS_PER_DEVICE, ac.COUNTERS_PER_STREAM, dtype=torch.int32)
    return registry


def test_each_stream_gets_its_own_row_and_keeps_it(counters):
    a = counters.for_stream(FakeStream(0, 11), tiles=9)
    b = counters.for_stream(FakeStream(0, 22), tiles=9)
    assert a.shape == (ac.SPLIT_K_COUNTERS,) and a.data_ptr() != b.data_ptr()
    assert counters.for_stream(FakeStream(0, 11), tiles=1).data_ptr() == a.data_ptr()


def test_chain_counters_are_the_row_tail_split_k_never_reaches(counters):
    """The trailing side chain's three counters and split-K's share a stream's row without overlapping."""
    split = counters.for_stream(FakeStream(0, 11), tiles=ac.SPLIT_K_COUNTERS)
    chain = counters.chain_for_stream(FakeStream(0, 11))
    assert chain.shape == (ac.CHAIN_COUNTERS,) == (3,)
    assert chain.data_ptr() == split.data_ptr() + split.numel() * split.element_size()
    assert chain.data_ptr() != counters.chain_for_stream(FakeStream(0, 22)).data_ptr()


def test_too_many_tiles_is_refused(counters):
    with pytest.raises(ValueError, match=f"{ac.SPLIT_K_COUNTERS + 1} output tiles"):
        counters.for_stream(FakeStream(0, 1), tiles=ac.SPLIT_K_COUNTERS + 1)


def test_running_out_of_rows_is_an_error_not_a_shared_row(counters):
    for handle in range(ac.STREAMS_PER_DEVICE):
        counters.for_stream(FakeStream(0, handle), tiles=1)
    with pytest.raises(RuntimeError, match="streams ran split-K kernels"):
        counters.for_stream(FakeStream(0, ac.STREAMS_PER_DEVICE), tiles=1)


def test_missing_arena_inside_capture_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="not reserved before CUDA-graph capture"):
        ac.ArrivalCounters().for_stream(FakeStream(3, 1), tiles=1)
