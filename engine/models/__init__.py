"""Model registry: architecture name (a config's ``model_type``) → ``CausalLM`` class,
and ``build_model``."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.models.base import CausalLM
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.quant import quantize_modules
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
}


def register_model(architecture: str, cls: type[CausalLM]) -> None:
    MODEL_REGISTRY[architecture] = cls


def build_model(
    config: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    weights: str = "fp32",
) -> CausalLM:
    """Allocate the model for ``config.architecture`` on ``device`` in ``dtype``, its
    matrices in ``weights`` (``engine.models.quant.CPU_WEIGHTS``: int8/int4 on the CPU).

    Parameters are uninitialised (no random init is paid for); fill them with
    ``load_weights`` or ``init_random_weights``. The RoPE table is ready. The model is
    in eval mode. Modules that say ``keeps_float32`` (MoE routers) stay in float32.
    ``device="meta"`` gives the shapes alone, at once, whatever the model's size.
    """
    try:
        cls = MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise NotImplementedError(f"architecture {config.architecture!r}") from None
    with torch.device("meta"):
        model = cls(config).to(dtype)
        for module in model.modules():
            if getattr(module, "keeps_float32", False):
                module.float()
        model = quantize_modules(model, weights)
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
    "Qwen3MoeForCausalLM",
    "build_model",
    "register_model",
]
