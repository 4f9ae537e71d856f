"""Frozen configuration objects, one per layer, composed into an EngineConfig.

Values that are only known at start (how many KV blocks fit, the model's own
context length) are resolved once into a *new* frozen object with
``dataclasses.replace``; nothing is written back after construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is "none" or "llama3"."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape and switches of a Llama-family decoder.

    One implementation covers SmolLM2 / Llama 3 (``rope_scaling.kind="llama3"``),
    Qwen2 (``attention_bias=True``) and Qwen3 (``qk_norm=True``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    architecture: str = "llama"
    name: str = "model"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def fingerprint(self) -> str:
        """Identifies the model's KV content (used in block hashes and file headers)."""
        return (
            f"{self.name}:{self.architecture}:{self.num_layers}x{self.num_kv_heads}x{self.head_dim}"
        )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (Llama, Qwen2, Qwen3).

        Null entries count as absent (transformers 5 writes ``"attention_bias": null``
        for Qwen2, which always has the bias, and may keep rope theta only under
        ``rope_parameters``)."""
        cfg = {k: v for k, v in cfg.items() if v is not None}
        model_type = cfg.get("model_type", "llama")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = RopeScaling()
        if rope.get("rope_type", rope.get("type")) == "llama3":
            scaling = RopeScaling(
                kind="llama3",
                factor=rope["factor"],
                low_freq_factor=rope["low_freq_factor"],
                high_freq_factor=rope["high_freq_factor"],
                original_max_position_embeddings=rope["original_max_position_embeddings"],
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            architecture=model_type,
            name=name,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. ``num_blocks=0`` means: size from ``memory_gb`` at start, or, when
    that is 0 too, from the context length (``engine.kv_cache.sizing.auto_kv_blocks``)."""

    block_size: int = 16
    num_blocks: int = 0
    memory_gb: float = 0.0
    enable_prefix_caching: bool = True
    cache_salt: str = ""
    # tiers below the cache (engine.kv_cache.tiered); off unless asked for (ferry serve does)
    host_memory_gb: float = 0.0  # host-memory tier (pinned where the cache is on a GPU)
    kv_dir: str = ""  # file tier directory, shared by the machine's workers ("": none)
    file_capacity_gb: float = 20.0
    file_ttl_hours: float = 72.0


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_model_len: int = 0  # 0: the model's own context length


@dataclass(frozen=True)
class StructuredOutputConfig:
    """Grammar compilation for structured output (``engine.structured``)."""

    grammar_cache_mb: int = 256  # compiled grammars kept (LRU, bounded in bytes)
    compile_threads: int = 1  # worker threads compiling grammars beside the step loop


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine process needs to start, composed from the parts above."""

    model: str = "default"  # path to a GGUF file / HF folder, "default", or "dummy:<preset>"
    device: str = "cpu"
    dtype: str = "float32"
    # matrices on the CPU (engine.models.quant): fp32, int8, int4; "auto": int4 for a GGUF
    # model on the CPU (its own 4/8-bit blocks, kept as they are), fp32 otherwise
    cpu_weights: str = "auto"
    seed: int = 0
    num_threads: int = 0  # 0: torch's default
    enforce_eager: bool = False  # on CUDA: no decode CUDA graphs, every step runs eagerly
    # plan step N+1 while step N runs (engine.core); None: on where the device runs
    # asynchronously to the host (CUDA), off on the CPU, where there is nothing to overlap
    overlap_scheduling: bool | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    structured: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def overlaps(self) -> bool:
        """Whether the engine overlaps scheduling with the device (``overlap_scheduling``)."""
        if self.overlap_scheduling is not None:
            return self.overlap_scheduling
        return self.device.split(":")[0] == "cuda"
