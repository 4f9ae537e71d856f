"""Shared fixtures: the default model and its tokenizer, loaded once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.loader import LoadedModel, default_model_path, load_model, load_tokenizer
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's torch work on one thread (restored after), unless OpenMP threads
    sleep when idle (``OMP_WAIT_POLICY=PASSIVE``).

    On a small machine shared with other processes, spinning OpenMP threads make torch
    several times slower with two threads than with one."""
    previous = torch.get_num_threads()
    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(default_gguf_path: Path) -> LoadedModel:
    """SmolLM2-135M-Instruct from the default GGUF, CPU float32."""
    return load_model("default", device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(default_gguf_path: Path) -> Tokenizer:
    return load_tokenizer("default")
