"""``--quantization fp8``: a MoE model's routed experts in FP8, on the CPU (the float32
function of the FP8 kernels, ``kernels.moe.fp8_moe_ref``; the kernels themselves are
tested on the GPU in tests/kernels/test_fp8_cuda.py and tests/engine/test_cuda_fp8_experts.py).

The stated error, for a tiny random DeepSeek-V3 with FP8 experts against the same model
in float32: an MoE layer's output within 8 % (relative norm, the routing held fixed: FP8
rounds each weight and activation to 3 mantissa bits, up to 6 % each; measured 5.9 %, and
0.065 at DeepSeek-V3's shape on the GPU), and each position's logits within 5 % of the
largest logit at the median. Not every position: where the FP8 hidden state tips a
router's choice between two near-equal experts the token takes another expert (seen:
3 positions of 40 at 15-24 %), as a bf16 model's tokens do against float32 now and then.
"""

from __future__ import annotations

import pytest
import torch
from helpers import forward_tokens, relative_error

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm import LLM
from engine.loader import check_quantization, load_model, load_model_config
from engine.models.moe import Experts, Fp8Experts, MoE
from engine.sampling_params import SamplingParams
from kernels.fp8 import FP8, dequantize_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP8_LAYER_ERROR = 0.08
FP8_LOGITS_ERROR = 0.05  # the median position's


@pytest.fixture(scope="module")
def folder(tiny_moe_dir):
    return tiny_moe_dir("deepseek-v3")


def test_every_routed_expert_is_quantized_and_its_weights_kept_within_fp8s_step(folder):
    plain = load_model(str(folder), progress=False)
    fp8 = load_model(str(folder), progress=False, quantization="fp8")
    pairs = [(a.mlp, b.mlp) for a, b in zip(plain.model.modules(), fp8.model.modules())
             if isinstance(getattr(a, "mlp", None), MoE)]  # fmt: skip
    assert pairs
    for before, after in pairs:
        assert isinstance(before.experts, Experts) and isinstance(after.experts, Fp8Experts)
        assert after.experts.w13.dtype == FP8 and after.experts.w2.dtype == FP8
        for name in ("w13", "w2"):
            weight = getattr(before.experts, name)
            back = dequantize_rows(getattr(after.experts, name),
                                   getattr(after.experts, f"{name}_scale"))  # fmt: skip
            assert ((back - weight).abs() <= weight.abs() * 2**-4 + 1e-6).all()
        assert after.shared_experts is not None  # shared experts stay in the model's dtype
        assert after.shared_experts.gate_up_proj.weight.dtype == torch.float32


def test_fp8_logits_are_the_float32_models_within_the_stated_error(folder):
    plain = load_model(str(folder), progress=False)
    fp8 = load_model(str(folder), progress=False, quantization="fp8")
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, plain.config.vocab_size, (40,), generator=g).tolist()
    with torch.inference_mode():
        expected = forward_tokens(plain.model, prompt, [30, 1, 9])
        got = forward_tokens(fp8.model, prompt, [30, 1, 9])
    per_position = (got - expected).abs().amax(-1) / expected.abs().max()
    assert 0 < per_position.median() < FP8_LOGITS_ERROR
    assert relative_error(got, expected) < 10 * FP8_LOGITS_ERROR
    g = torch.Generator().manual_seed(4)
    for before, after in zip(plain.model.modules(), fp8.model.modules()):
        if isinstance(before, MoE):
            x = torch.randn(64, plain.config.hidden_size, generator=g)
            weights, ids = before.gate(x)
            exact = before.experts(x, ids, weights)
            error = (after.experts(x, ids, weights) - exact).norm() / exact.norm()
            assert 0 < error < FP8_LAYER_ERROR


def test_fp8_engine_generates_alike_alone_batched_and_from_the_prefix_cache(folder):
    llm = LLM(EngineConfig(
        model=str(folder), num_threads=1, quantization="fp8",
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=48),
    ))  # fmt: skip
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (9, 37, 20)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [llm.generate([p], greedy)[0].token_ids for p in prompts]
    batched = llm.generate(prompts, greedy)  # their prefixes cached now
    assert [o.token_ids for o in batched] == alone
    assert all(o.num_cached_tokens > 0 for o in batched[1:])
    llm.core.kv.pool.check_integrity()


def test_quantization_is_refused_with_what_to_change():
    with pytest.raises(ValueError, match="has none"):
        check_quantization("fp8", load_model_config("dummy:tiny"))
    with pytest.raises(ValueError, match="expected one of"):
        check_quantization("int3", load_model_config("dummy:deepseek-v3-tiny"))
    moe = load_model_config("dummy:deepseek-v3-tiny")
    check_quantization("fp8", moe, "cpu", torch.float32)
    with pytest.raises(ValueError, match="--dtype bfloat16"):  # asked of no GPU
        check_quantization("fp8", moe, "cuda", "float32", gpu=False)
    check_quantization("fp8", moe, "cuda:0", torch.bfloat16, gpu=False)
