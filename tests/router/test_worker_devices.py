"""Which device each worker process of a disaggregated topology runs on."""

import pytest
import torch

from router.pools import worker_devices


def test_cpu_and_explicit_devices_are_shared_by_every_worker():
    assert worker_devices("cpu", 3) == ["cpu"] * 3
    assert worker_devices("cuda:1", 2) == ["cuda:1"] * 2


def test_bare_cuda_spreads_workers_over_the_visible_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert worker_devices("cuda", 5) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]


def test_bare_cuda_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="no GPU"):
        worker_devices("cuda", 2)


def test_a_frontend_that_starts_no_workers_needs_no_gpu():
    """The Kubernetes frontends: --device cuda in the shared topology, workers elsewhere
    (on this machine, with or without GPUs)."""
    assert worker_devices("cuda", 0) == []
