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


def _own_kv_dir(request: pytest.FixtureRequest, factory: pytest.TempPathFactory):
    """Point ``FERRY_KV_DIR`` (the default of ``ferry serve --kv-dir``) at a fresh
    directory while the fixture's scope lasts."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FERRY_KV_DIR", str(factory.mktemp(f"kv-{request.scope}")))
        yield


# A server started in a test, a module fixture or a session fixture gets a KV file tier of
# its own (autouse fixtures run first in their scope): no test sees blocks that another
# test's server wrote, and nothing lands in the user's cache directory.
@pytest.fixture(scope="session", autouse=True)
def _session_kv_dir(request, tmp_path_factory):
    yield from _own_kv_dir(request, tmp_path_factory)


@pytest.fixture(scope="module", autouse=True)
def _module_kv_dir(request, tmp_path_factory):
    yield from _own_kv_dir(request, tmp_path_factory)


@pytest.fixture(autouse=True)
def _test_kv_dir(request, tmp_path_factory):
    yield from _own_kv_dir(request, tmp_path_factory)


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
