"""Speculative decoding that cannot work is refused when the engine is built, with a
message that names the model and says what it lacks: ``mtp`` on a checkpoint without
multi-token prediction weights, a draft model whose vocabulary is not the target's, a
confidence-temperature list that is not one value per draft position."""

from __future__ import annotations

import pytest
import torch
from hf_models import OTHER_CONFIGS

from engine.config import EngineConfig, SpeculativeConfig
from engine.llm import LLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build(model: str, **speculative) -> LLM:
    return LLM(EngineConfig(model=model, num_threads=1,
                            speculative=SpeculativeConfig(num_speculative_tokens=2,
                                                          **speculative)))  # fmt: skip


# deepseek-v3: transformers writes num_nextn_predict_layers 1 but not the layer's weights
@pytest.mark.parametrize("kind", ["llama", "deepseek-v3"])
def test_mtp_on_a_model_without_mtp_weights_is_refused_naming_the_model(kind, tiny_moe_dir):
    folder = tiny_moe_dir(kind)
    with pytest.raises(ValueError) as refused:
        build(str(folder), method="mtp")
    message = str(refused.value)
    assert "--speculative mtp" in message and folder.name in message
    assert "no multi-token prediction layers" in message


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_moe_dir, tmp_path):
    """The draft's 300 tokens against the target's 260: it must share the tokenizer."""
    from transformers import AutoModelForCausalLM

    config = OTHER_CONFIGS["llama"]()
    config.vocab_size = 300
    draft = tmp_path / "draft-300"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(draft)
    with pytest.raises(ValueError) as refused:
        build(str(tiny_moe_dir("llama")), method="draft", draft_model=str(draft))
    message = str(refused.value)
    assert str(draft) in message and "300 tokens" in message and "the target 260" in message
    assert "needs the target's tokenizer" in message


@pytest.mark.parametrize("temps", [(0.5,), (1.0, 0.9), (1.0, 0.9, 0.8, 0.7)])
def test_confidence_temperatures_must_be_one_per_draft_position(temps):
    with pytest.raises(ValueError, match=f"{len(temps)} confidence temperatures for 3 draft "
                                         "positions: give exactly 3"):  # fmt: skip
        SpeculativeConfig(method="mtp", num_speculative_tokens=3, confidence_temperatures=temps)
    given = SpeculativeConfig(method="mtp", num_speculative_tokens=3,
                              confidence_temperatures=(1.0, 0.9, 0.8))  # fmt: skip
    assert [given.temperature(i) for i in range(3)] == [1.0, 0.9, 0.8]
    default = SpeculativeConfig(method="mtp", num_speculative_tokens=3)
    assert [default.temperature(i) for i in range(3)] == [1.0, 1.0, 1.0]  # uncalibrated
