"""Hugging Face folders: ``config.json`` + ``*.safetensors`` (+ tokenizer files)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig

logger = logging.getLogger(__name__)


def read_hf_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def hf_model_config(path: Path, name: str) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face folder (llama, qwen2, qwen3, mistral)."""
    return ModelConfig.from_hf_config(read_hf_config(path), name=name)


def safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def iter_hf_weights(
    path: Path, device: torch.device | str = "cpu", progress: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from every safetensors file, read straight onto ``device``."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = safetensors_files(path)
    bar = tqdm(total=len(files), desc=f"loading {path.name}", unit="file", file=sys.stderr,
               disable=not progress, leave=False)  # fmt: skip
    with bar:
        for file in files:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield key, f.get_tensor(key)
            bar.update(1)


def has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").exists()
