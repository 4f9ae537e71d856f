"""Model registry: architecture name (a config's ``model_type``) → ``CausalLM`` class,
and ``build_model``."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.models.base import CausalLM
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.quant import quantize_modules
from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration, VisionTransformer
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
}


def register_model(architecture: str, cls: type[CausalLM]) -> None:
    MODEL_REGISTRY[architecture] = cls


def build_model(
    config: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    weights: str = "fp32",
    vision: bool = True,
) -> CausalLM:
    """Allocate the model for ``config.architecture`` on ``device`` in ``dtype``, its
    matrices in ``weights`` (``engine.models.quant.CPU_WEIGHTS``: int8/int4 on the CPU).

    Parameters are uninitialised (no random init is paid for); fill them with
    ``load_weights`` or ``init_random_weights``. The RoPE table is ready. The model is
    in eval mode. Modules that say ``keeps_float32`` (MoE routers) stay in float32.
    ``device="meta"`` gives the shapes alone, at once, whatever the model's size.
    ``vision`` False: a vision-language model without its tower (``model.visual`` None;
    its images are encoded elsewhere), dropped before anything is allocated.
    """
    try:
        cls = MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise NotImplementedError(f"architecture {config.architecture!r}") from None
    if config.vision is not None and weights != "fp32":
        raise ValueError(f"{weights} weights: text-only models (this one has a vision tower)")
    with torch.device("meta"):
        model = cls(config).to(dtype)
        if not vision and getattr(model, "visual", None) is not None:
            model.visual = None
        for module in model.modules():
            if getattr(module, "keeps_float32", False):
                module.float()
        model = quantize_modules(model, weights)
    return _materialise(model, device)


def build_vision_model(
    config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> VisionTransformer:
    """The vision tower of ``config`` alone (an encode worker's model), as ``build_model``
    allocates a model: uninitialised, on ``device``, in eval mode."""
    if config.vision is None:
        raise ValueError(f"{config.name} has no vision tower")
    with torch.device("meta"):
        tower = VisionTransformer(config.vision).to(dtype)
    return _materialise(tower, device)


def _materialise(model: torch.nn.Module, device: torch.device | str):
    # like ``to_empty``, whose ``empty_like`` on meta tensors imports sympy (3.6 s of start-up)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    for module in model.modules():
        if hasattr(module, "reset_cache"):
            module.reset_cache()
    return model.eval().requires_grad_(False)


__all__ = [
    "CausalLM",
    "DeepseekV3ForCausalLM",
    "LlamaForCausalLM",
    "MODEL_REGISTRY",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3MoeForCausalLM",
    "VisionTransformer",
    "build_model",
    "build_vision_model",
    "register_model",
]
