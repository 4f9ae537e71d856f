"""Hugging Face folders: ``config.json`` + ``*.safetensors`` (+ tokenizer files).

A sharded checkpoint's files are the ones its ``model.safetensors.index.json`` names;
without an index, every ``*.safetensors`` in the folder. A checkpoint whose config has a
``quantization_config`` is dequantized while it streams (``engine.loader.fp8``: DeepSeek's
block-scaled FP8). ``num_mtp_layers`` counts the multi-token prediction layers the
checkpoint really holds (transformers writes ``num_nextn_predict_layers`` without them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.loader.fp8 import dequantize_fp8, fp8_block_size

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def read_hf_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file of the folder, or {} when it is absent."""
    return json.loads(path.read_text()) if path.exists() else {}


def hf_model_config(path: Path, name: str) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face folder (``engine.models.MODEL_REGISTRY``'s
    architectures), with as many MTP layers as the checkpoint holds."""
    config = ModelConfig.from_hf_config(read_hf_config(path), name=name)
    if not config.num_mtp_layers:
        return config
    layers = {int(m.group(1)) for n in tensor_names(path) if (m := _LAYER.match(n))}
    held = sum(1 for i in range(config.num_mtp_layers) if config.num_layers + i in layers)
    if held != config.num_mtp_layers:
        logger.info("%s: config declares %d MTP layers, the checkpoint holds %d",
                    path, config.num_mtp_layers, held)  # fmt: skip
    return dataclasses.replace(config, num_mtp_layers=held)


def safetensors_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def tensor_names(path: Path) -> list[str]:
    """Every tensor name in the checkpoint (from the index, or the files' headers)."""
    index = path / INDEX_FILE
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    names: list[str] = []
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    return names


def iter_hf_weights(
    path: Path, device: torch.device | str = "cpu", progress: bool = False,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """Yield ``(name, tensor)`` from every safetensors file, read straight onto ``device``
    (dequantized when the checkpoint is quantized); ``keep``: only the tensors whose name
    it accepts are read."""
    weights = _read_files(path, device, progress, keep)
    quantization = read_hf_config(path).get("quantization_config")
    if quantization:
        return dequantize_fp8(weights, fp8_block_size(quantization))
    return weights


def _read_files(
    path: Path, device: torch.device | str, progress: bool, keep: Callable[[str], bool] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    from tqdm import tqdm

    files = safetensors_files(path)
    bar = tqdm(total=len(files), desc=f"loading {path.name}", unit="file", file=sys.stderr,
               disable=not progress, leave=False)  # fmt: skip
    with bar:
        for file in files:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if keep is None or keep(key):
                        yield key, f.get_tensor(key)
            bar.update(1)


def has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").exists()
