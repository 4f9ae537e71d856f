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
    """RoPE frequency scaling. ``kind`` is "none", "llama3" or "yarn".

    YaRN (DeepSeek-V3, long-context Qwen3) uses ``factor``, ``original_max_position_embeddings``,
    ``beta_fast``/``beta_slow`` (the ramp between extrapolated and interpolated frequencies),
    ``truncate`` (round the ramp's ends), and ``mscale``/``mscale_all_dim`` (0: absent) or an
    explicit ``attention_factor`` (the cos/sin magnitude); ``engine.models.rotary`` reads them
    the way transformers does.
    """

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, rope: dict[str, Any], max_position_embeddings: int) -> RopeScaling:
        """From a ``rope_scaling`` / ``rope_parameters`` dict (null entries dropped)."""
        kind = rope.get("rope_type", rope.get("type"))
        original = rope.get("original_max_position_embeddings", max_position_embeddings)
        if kind == "llama3":
            return cls(
                kind="llama3",
                factor=rope["factor"],
                low_freq_factor=rope["low_freq_factor"],
                high_freq_factor=rope["high_freq_factor"],
                original_max_position_embeddings=original,
            )
        if kind == "yarn":
            return cls(
                kind="yarn",
                factor=rope.get("factor", max_position_embeddings / original),
                original_max_position_embeddings=original,
                beta_fast=rope.get("beta_fast", 32.0),
                beta_slow=rope.get("beta_slow", 1.0),
                mscale=rope.get("mscale", 0.0),
                mscale_all_dim=rope.get("mscale_all_dim", 0.0),
                attention_factor=rope.get("attention_factor"),
                truncate=rope.get("truncate", True),
            )
        if kind not in (None, "default", "mrope"):  # M-RoPE: the sections, not a scaling
            raise NotImplementedError(f"rope scaling {kind!r}")
        return cls()


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3).

    Queries come from ``hidden`` directly (``q_lora_rank`` None) or through a rank
    ``q_lora_rank`` bottleneck; keys and values from one latent per token: ``kv_lora_rank``
    compressed values plus one ``qk_rope_head_dim`` rotary key shared by all heads, which is
    all the KV cache holds. Each head's key is ``qk_nope_head_dim`` decompressed dims plus
    the rotary ones; its value ``v_head_dim`` decompressed dims. ``rope_interleave``: the
    rotary dims pair up as (0, 1), (2, 3), ... (DeepSeek's checkpoints), not as halves.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one token's cached latent: compressed values + the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> MLAConfig:
        return cls(
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            q_lora_rank=cfg.get("q_lora_rank"),
            rope_interleave=cfg.get("rope_interleave", True),
        )


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts in place of the MLP on every layer not in ``dense_layers``.

    Routing (``engine.models.moe.Router``): ``scoring`` ("softmax": Qwen3; "sigmoid":
    DeepSeek-V3) turns the router's logits into scores; with ``score_correction_bias`` a
    learnt per-expert bias is added to the scores for *choosing* experts only; with
    ``num_groups`` > 1 the experts split into groups, each group is ranked by the sum of
    its two best scores and only the best ``topk_groups`` groups compete; the ``top_k``
    best experts are kept, their weights are the unbiased scores, renormalised to sum to 1
    when ``norm_topk_prob``, then multiplied by ``routed_scaling_factor``.
    ``num_shared_experts`` experts (one MLP of ``num_shared_experts * intermediate_size``)
    see every token.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    num_shared_experts: int = 0
    scoring: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    score_correction_bias: bool = False
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE scoring {self.scoring!r}")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError("experts must split evenly into num_groups >= topk_groups groups")

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], num_layers: int) -> MoEConfig | None:
        """DeepSeek-V3 (``n_routed_experts``) or Qwen3-MoE (``num_experts``, written by
        transformers as ``num_local_experts``); None when the model has no experts."""
        if cfg.get("model_type") == "deepseek_v3":
            return cls(
                num_experts=cfg["n_routed_experts"],
                top_k=cfg["num_experts_per_tok"],
                intermediate_size=cfg["moe_intermediate_size"],
                num_shared_experts=cfg.get("n_shared_experts", 0),
                scoring="sigmoid",
                norm_topk_prob=cfg.get("norm_topk_prob", True),
                routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
                num_groups=cfg.get("n_group", 1),
                topk_groups=cfg.get("topk_group", 1),
                score_correction_bias=True,
                dense_layers=tuple(range(min(cfg.get("first_k_dense_replace", 0), num_layers))),
            )
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
        if not num_experts:
            return None
        step = cfg.get("decoder_sparse_step", 1)
        only_mlp = set(cfg.get("mlp_only_layers", ()))
        dense = tuple(i for i in range(num_layers) if i in only_mlp or (i + 1) % step)
        return cls(
            num_experts=num_experts,
            top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"],
            norm_topk_prob=cfg.get("norm_topk_prob", False),
            dense_layers=dense,
        )


@dataclass(frozen=True)
class VisionConfig:
    """A vision tower and how its image tokens sit in the language model's prompt
    (Qwen2.5-VL: a ViT over ``patch_size`` patches with window attention in windows of
    ``window_size`` pixels except on ``fullatt_block_indexes``, then an MLP that merges
    each ``spatial_merge_size`` x ``spatial_merge_size`` patches into one language-model
    token of width ``out_hidden_size``).

    An image becomes ``grid_h * grid_w / spatial_merge_size**2`` copies of
    ``image_token_id`` between ``vision_start_token_id`` and ``vision_end_token_id``; the
    tower's outputs replace those tokens' embeddings.
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("the vision hidden size must split evenly into its heads")
        if (self.hidden_size // self.num_heads) % 4:
            raise ValueError("the vision head width must be a multiple of 4 (2D rotary)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_width(self) -> int:
        """Values of one flattened patch as the image processor emits it."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def fingerprint(self) -> str:
        """Identifies what the tower computes (with the model's name: its weights)."""
        full = ",".join(map(str, self.fullatt_block_indexes))
        return (f"vit{self.depth}x{self.hidden_size}h{self.num_heads}p{self.patch_size}"
                f"m{self.spatial_merge_size}w{self.window_size}f{full}>{self.out_hidden_size}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], top: dict[str, Any]) -> VisionConfig:
        """From a Qwen2.5-VL ``vision_config`` and the top-level config's token ids."""
        rope = cfg.get("rope_parameters") or {}
        return cls(
            depth=cfg["depth"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_heads=cfg["num_heads"],
            out_hidden_size=cfg["out_hidden_size"],
            image_token_id=top["image_token_id"],
            vision_start_token_id=top["vision_start_token_id"],
            vision_end_token_id=top["vision_end_token_id"],
            patch_size=cfg.get("patch_size", 14),
            spatial_merge_size=cfg.get("spatial_merge_size", 2),
            temporal_patch_size=cfg.get("temporal_patch_size", 2),
            in_channels=cfg.get("in_channels", cfg.get("in_chans", 3)),
            window_size=cfg.get("window_size", 112),
            fullatt_block_indexes=tuple(cfg.get("fullatt_block_indexes", ())),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )


# transformers' class names → ferry's architecture names, for configs without model_type
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}


def hf_architecture(cfg: dict[str, Any]) -> str:
    """The architecture of a ``config.json``: its ``model_type``, else its first
    ``architectures`` entry, else llama."""
    if cfg.get("model_type"):
        return cfg["model_type"]
    names = cfg.get("architectures") or []
    return _ARCHITECTURES.get(names[0], names[0]) if names else "llama"


@dataclass(frozen=True)
class ModelConfig:
    """Shape and switches of a decoder.

    The Llama family is one implementation: SmolLM2 / Llama 3 (``rope_scaling.kind=
    "llama3"``), Qwen2 (``attention_bias=True``) and Qwen3 (``qk_norm=True``). Two optional
    parts extend it: ``mla`` (multi-head latent attention in place of GQA; ``num_kv_heads``
    is then ``num_heads`` and ``head_dim`` the query/key head width) and ``moe`` (experts in
    place of the MLP on most layers; ``intermediate_size`` stays the dense layers' width).
    DeepSeek-V3 has both, Qwen3-MoE only ``moe``. ``num_mtp_layers``: multi-token
    prediction layers that follow the decoder (DeepSeek-V3's, loaded, not run yet).
    ``vision``: the vision tower of a vision-language model (Qwen2.5-VL), whose language
    model is Qwen2's with M-RoPE: ``mrope_section`` splits the rotary frequencies into
    three parts turned by three position streams (time, height, width;
    ``engine.models.rotary.MRotaryEmbedding``).
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
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    num_mtp_layers: int = 0
    vision: VisionConfig | None = None
    mrope_section: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.mrope_section and sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError("mrope_section must split the head's rotary half exactly")
        if self.mla is not None and self.head_dim != self.mla.qk_head_dim:
            raise ValueError("with MLA, head_dim is qk_nope_head_dim + qk_rope_head_dim")

    @property
    def fingerprint(self) -> str:
        """Identifies the model's KV content (used in block hashes and file headers)."""
        shape = f"{self.num_layers}x{self.num_kv_heads}x{self.head_dim}"
        if self.mla is not None:
            shape = f"{self.num_layers}xmla{self.mla.kv_lora_rank}+{self.mla.qk_rope_head_dim}"
        if self.moe is not None:
            shape += f"-moe{self.moe.num_experts}top{self.moe.top_k}"
        if self.vision is not None:  # image tokens' KV is what this tower made of them
            shape += f"-{self.vision.fingerprint}"
        return f"{self.name}:{self.architecture}:{shape}"

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (Llama, Qwen2, Qwen3, Qwen3-MoE,
        DeepSeek-V3).

        Null entries count as absent (transformers 5 writes ``"attention_bias": null``
        for Qwen2, which always has the bias, and may keep rope theta only under
        ``rope_parameters``). A vision-language config (Qwen2.5-VL) has its language
        model under ``text_config`` and its tower under ``vision_config``."""
        cfg = {k: v for k, v in cfg.items() if v is not None}
        arch = hf_architecture(cfg)
        vision = None
        if arch == "qwen2_5_vl":
            vision = VisionConfig.from_hf(cfg["vision_config"], cfg)
            text = {k: v for k, v in cfg.get("text_config", {}).items() if v is not None}
            cfg = {**{k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")},
                   **text}  # fmt: skip
        heads = cfg["num_attention_heads"]
        max_positions = cfg.get("max_position_embeddings", 8192)
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope = {k: v for k, v in rope.items() if v is not None}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        mla = MLAConfig.from_hf(cfg) if "kv_lora_rank" in cfg else None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            # MLA has no KV heads: every head reads the one latent (transformers' default
            # num_key_value_heads of 128 means nothing there)
            num_kv_heads=heads if mla else cfg.get("num_key_value_heads", heads),
            head_dim=mla.qk_head_dim if mla else cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=RopeScaling.from_hf(rope, max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch in ("qwen2", "qwen2_5_vl")),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            architecture=arch,
            name=name,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            mla=mla,
            moe=MoEConfig.from_hf(cfg, cfg["num_hidden_layers"]),
            num_mtp_layers=cfg.get("num_nextn_predict_layers", 0),
            vision=vision,
            mrope_section=tuple(rope.get("mrope_section", ())) if vision else (),
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
    file_capacity_gb: float = 20.0  # bounded by free disk space too (a margin is kept)
    file_ttl_hours: float = 72.0
    file_mode: int = 0o600  # permission bits of block files: they hold what prompts computed

    def tiers_summary(self) -> str:
        """The tiers below the cache in one phrase, for start-up logs: ``host 0.47 GB, file
        /var/kv (cap 20 GB, TTL 72 h)``, or ``none``."""
        parts = []
        if self.host_memory_gb > 0:
            parts.append(f"host {self.host_memory_gb:.2f} GB")
        if self.kv_dir:
            parts.append(f"file {self.kv_dir} (cap {self.file_capacity_gb:g} GB, "
                         f"TTL {self.file_ttl_hours:g} h)")  # fmt: skip
        if not self.enable_prefix_caching or not parts:
            return "none"
        return ", ".join(parts)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_model_len: int = 0  # 0: the model's own context length


EMBED_BLOCK_SIZE = 64  # image embedding rows per block (transports and the file tier move blocks)

SPEC_SCHEDULES = ("dynamic", "fixed")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``engine.spec``): who drafts and how many drafts are verified.

    ``method``: "none", "ngram" (prompt lookup, no weights), "mtp" (the model's own
    multi-token-prediction layers, DeepSeek-V3), "draft" (``draft_model``: a small model
    with the target's tokenizer), or any drafter registered in ``engine.spec.DRAFTERS``.
    ``num_speculative_tokens`` (K) is the most drafts a request gets verified in one step.
    ``schedule``: "dynamic" chooses each step how many drafts to verify in all and which
    requests get them (``engine.spec.policy``); "fixed" verifies up to K for every
    request. ``confidence_temperatures``: per draft position, the temperature that
    calibrates a model drafter's (MTP's, a draft model's) probability of its token into an
    acceptance estimate; exactly K values, one per position (any other length is refused
    here, at start); none given: 1 at every position, the probabilities as they are.
    ``ngram_min`` / ``ngram_max``: the suffix lengths prompt lookup matches.
    """

    method: str = "none"
    num_speculative_tokens: int = 0
    schedule: str = "dynamic"
    draft_model: str = ""
    confidence_temperatures: tuple[float, ...] = ()
    ngram_min: int = 1
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if not self.method:
            raise ValueError("a speculative method, or none")
        if self.schedule not in SPEC_SCHEDULES:
            raise ValueError(f"spec schedule {self.schedule!r}; one of {SPEC_SCHEDULES}")
        if self.method == "none":
            return
        k = self.num_speculative_tokens
        if not 1 <= k <= 16:
            raise ValueError(f"--num-speculative-tokens must be in [1, 16] with {self.method!r}"
                             f" speculation, got {k}")  # fmt: skip
        if self.method == "draft" and not self.draft_model:
            raise ValueError("draft speculation needs a draft model path (draft:PATH)")
        temps = self.confidence_temperatures
        if temps and len(temps) != k:
            raise ValueError(f"{len(temps)} confidence temperatures for {k} draft "
                             f"positions: give exactly {k}, one per position")  # fmt: skip
        if any(t <= 0 for t in temps):
            raise ValueError(f"confidence temperatures must be > 0, got {temps}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"n-gram lengths {self.ngram_min}..{self.ngram_max}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def max_draft(self) -> int:
        """K: the most drafts verified per request and step (0 without speculation)."""
        return self.num_speculative_tokens if self.enabled else 0

    def temperature(self, position: int) -> float:
        """The calibration temperature of draft position ``position`` (0-based)."""
        temps = self.confidence_temperatures
        return temps[position] if temps else 1.0

    @classmethod
    def parse(cls, spec: str, **fields: Any) -> SpeculativeConfig:
        """From ``--speculative``'s text: ``ngram``, ``mtp``, ``draft:PATH`` or ``none``."""
        method, _, path = spec.partition(":")
        if method == "draft":
            return cls(method="draft", draft_model=path, **fields)
        if path:
            raise ValueError(f"--speculative {spec!r}: only draft takes a path")
        return cls(method=method, **fields)


@dataclass(frozen=True)
class StructuredOutputConfig:
    """Grammar compilation for structured output (``engine.structured``)."""

    grammar_cache_mb: int = 256  # compiled grammars kept (LRU, bounded in bytes)
    compile_threads: int = 1  # worker threads compiling grammars beside the step loop


@dataclass(frozen=True)
class ExpertParallelConfig:
    """How the routed experts of a MoE model are spread and balanced (``engine.ep``).

    The group itself (its size, this process's rank, the rendezvous) comes from the worker
    (``engine.worker.config.GroupMember``); this part is what every rank shares.
    ``redundant_experts``: physical expert slots per group beyond one per logical expert
    (a multiple of the group's size; each rank holds ``(experts + R) / size`` slots).
    ``eplb_interval``: rebalance every this many steps of the group (0: never);
    ``eplb_window``: the steps whose routed tokens the balancer counts. ``routing_trace``:
    a directory each worker writes its routing trace into, one file per rank ("": none).
    ``timeout_s``: how long a collective of the group may wait for a peer before the rank
    gives up (a peer that died is seen at once on gloo; this bounds a hung one)."""

    redundant_experts: int = 0
    eplb_interval: int = 0
    eplb_window: int = 1000
    routing_trace: str = ""
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.redundant_experts < 0 or self.eplb_interval < 0 or self.eplb_window < 1:
            raise ValueError("redundant experts and the EPLB interval are >= 0, the window >= 1")
        if not self.timeout_s > 0:
            raise ValueError("the group's collective timeout must be positive")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine process needs to start, composed from the parts above."""

    model: str = "default"  # path to a GGUF file / HF folder, "default", or "dummy:<preset>"
    device: str = "cpu"
    dtype: str = "float32"
    # matrices on the CPU (engine.models.quant): fp32, int8, int4; "auto": int4 for a GGUF
    # model on the CPU (its own 4/8-bit blocks, kept as they are), fp32 otherwise
    cpu_weights: str = "auto"
    # "fp8": a MoE model's routed experts in FP8 e4m3, a scale per output channel
    # (engine.models.moe.Fp8Experts); "none": every weight in ``dtype``
    quantization: str = "none"
    seed: int = 0
    num_threads: int = 0  # 0: torch's default
    # no CUDA graphs (CUDA) or recorded decode programs (CPU): every step runs eagerly
    enforce_eager: bool = False
    # on CUDA: steps with prompt tokens, up to this many tokens (and the step's token
    # budget), replay graph pieces between eager attentions (engine.piecewise_graphs); 0: eager
    piecewise_graph_tokens: int = 512
    # plan step N+1 while step N runs (engine.core); None: on where the device runs
    # asynchronously to the host (CUDA), off on the CPU, where there is nothing to overlap
    overlap_scheduling: bool | None = None
    # a vision-language model: build its vision tower and encode the images requests bring
    # (False: a worker whose images are encoded elsewhere, or that gets their KV)
    vision: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    structured: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    ep: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def overlaps(self) -> bool:
        """Whether the engine overlaps scheduling with the device (``overlap_scheduling``)."""
        if self.overlap_scheduling is not None:
            return self.overlap_scheduling
        return self.device.split(":")[0] == "cuda"
