"""The quantized CPU path (``--cpu-weights int4``/``int8``) against float32, on the default
model.

Metric: ``relative_error`` = max |quantized - fp32| / max |fp32| over every logit of the
chat prompt, computed in chunks so that both paths run: the first chunk (over
``KERNEL_MAX_ROWS`` tokens) on dequantized weights and torch's GEMM, the rest on the
integer kernel with 16-bit activations. Bounds: int4 (the GGUF's own Q4_1/Q8_0 blocks,
so only the activations' rounding differs) 1e-3; int8 (Q4_1 requantized to 8 bits: 0.036
measured) 5e-2.
"""

from __future__ import annotations

import pytest
from helpers import forward_tokens, greedy_generate, relative_error

from engine.cpu_kernels import cpu_kernels
from engine.loader import LoadedModel, load_model
from engine.models.quant import KERNEL_MAX_ROWS, QuantEmbedding, QuantLinear, weight_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

README_CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Is the sky blue?",
    "Describe Paris as JSON.",
]
TOLERANCE = {"int4": 1e-3, "int8": 5e-2}


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized(request) -> tuple[str, LoadedModel]:
    return request.param, load_model("default", weights=request.param, progress=False)


def _chat(model: LoadedModel, question: str) -> list[int]:
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return model.tokenizer.encode(text, add_special_tokens=False)


def test_quantized_logits_stay_within_tolerance_of_fp32(quantized, smollm2):
    weights, model = quantized
    ids = _chat(smollm2, README_CHATS[0])
    chunks = [len(ids) - 12, 1, 3, 8]  # one long chunk, then kernel-sized ones
    assert chunks[0] > KERNEL_MAX_ROWS
    ours = forward_tokens(model.model, ids, chunks)
    ref = forward_tokens(smollm2.model, ids, chunks)
    assert relative_error(ours, ref) <= TOLERANCE[weights]


@pytest.mark.parametrize("question", README_CHATS)
def test_int4_greedy_answers_to_readme_prompts_are_unchanged(quantized, smollm2, question):
    weights, model = quantized
    if weights != "int4":
        pytest.skip("the serving default is int4")
    ids = _chat(smollm2, question)
    eos = smollm2.config.eos_token_ids
    expected = greedy_generate(smollm2.model, ids, 32, eos)
    assert greedy_generate(model.model, ids, 32, eos) == expected


def test_int4_answer_is_paris(quantized):
    weights, model = quantized
    ids = _chat(model, README_CHATS[0])
    out = greedy_generate(model.model, ids, 12, model.config.eos_token_ids)
    if weights == "int4":
        assert model.tokenizer.decode(out) == "The capital of France is Paris."
    else:
        assert "Paris" in model.tokenizer.decode(out)


def test_quantized_model_holds_its_matrices_in_blocks(quantized, smollm2):
    weights, model = quantized
    modules = list(model.model.modules())
    assert sum(isinstance(m, QuantLinear) for m in modules) == 4 * model.config.num_layers
    assert isinstance(model.model.model.embed_tokens, QuantEmbedding)
    share = weight_bytes(model.model) / weight_bytes(smollm2.model)
    assert share < (0.25 if weights == "int4" else 0.33)


def test_the_kernels_are_built_here():
    """The machines this project runs on have a C compiler: the fast path is what runs."""
    assert cpu_kernels() is not None


def _int4_linear(in_features: int = 256, out_features: int = 96) -> QuantLinear:
    import torch

    from kernels.cpu_quant import Q4

    torch.manual_seed(0)
    layer = QuantLinear(in_features, out_features, Q4, bias=False)
    layer.load(torch.randn(out_features, in_features) * 0.05, None)
    return layer


def test_a_decode_row_gets_the_same_arithmetic_whatever_shares_its_step():
    """A verify step of 8 requests with 2 drafts each is 24 rows, past the kernel's row
    count, and took the float GEMM where the same tokens decoded alone took the integer
    kernel: a near tie came out otherwise with speculation. Decode rows (said by the
    runner, ``decode_rows``) now take the kernel whatever their number, beside prefill
    rows too, which keep the GEMM."""
    import torch

    from engine.models.quant import decode_rows

    layer = _int4_linear()
    x = torch.randn(3 * KERNEL_MAX_ROWS, layer.in_features)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    assert not torch.equal(layer(x), alone)  # by count: the GEMM rounds otherwise
    with decode_rows(True):
        assert torch.equal(layer(x), alone)
    mask = torch.zeros(x.shape[0], dtype=torch.bool)
    mask[::5] = True  # a mixed step: some decode rows among a prompt's
    with decode_rows(mask):
        mixed = layer(x)
    assert torch.equal(mixed[mask], alone[mask])
    assert torch.equal(mixed[~mask], layer(x[~mask]))  # the prompt's rows: by their count
