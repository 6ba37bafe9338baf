"""runtime/host_threads.py: a CUDA engine runs torch's host ops on one thread, a CPU engine
keeps its pool, and OMP_NUM_THREADS stays the operator's choice."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.runtime.host_threads import limit_host_threads


@pytest.fixture
def threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def test_cuda_engine_gets_one_thread(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert limit_host_threads(torch.device("cuda")) == 2
    assert torch.get_num_threads() == 1
    assert limit_host_threads(torch.device("cuda")) is None  # already one: nothing to do


def test_cpu_engine_and_operator_choice_are_kept(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert limit_host_threads(torch.device("cpu")) is None
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert limit_host_threads(torch.device("cuda")) is None
    assert torch.get_num_threads() == 2
