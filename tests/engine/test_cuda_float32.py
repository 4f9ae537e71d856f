"""A float32 model on CUDA (attention through torch SDPA: TileLang's kernels take bf16 or
fp16) generates what the same model generates on the CPU: the tiny Qwen2.5-VL of the
tests, greedy, with one image and with two, decode steps from CUDA graphs and eager.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from hf_models import VL_IMAGE_TOKEN, random_image, write_tiny_vlm

from engine.attention import TorchSDPABackend
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm import LLM
from engine.loader import load_image_processor
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from engine.vision import place_images, prepare_image

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SIZES = [(130, 100), (90, 150), (200, 120)]


def _llm(folder, device: str, enforce_eager: bool = False) -> LLM:
    return LLM(EngineConfig(
        model=str(folder), device=device, dtype="float32", num_threads=1,
        enforce_eager=enforce_eager,
        cache=CacheConfig(block_size=16, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    ))  # fmt: skip


def _prompt(folder, images: list[bytes], text: str):
    tokenizer = Tokenizer.from_pretrained_dir(folder)
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": parts}]))
    processor = load_image_processor(str(folder))
    return place_images(ids, VL_IMAGE_TOKEN, [prepare_image(processor, d, 1 << 24) for d in images])


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_float32_on_cuda_generates_what_the_cpu_generates(tmp_path, enforce_eager):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    folder = write_tiny_vlm(tmp_path / "tiny-vlm")
    images = [random_image(i, w, h) for i, (w, h) in enumerate(SIZES)]
    cases = [_prompt(folder, images[:1], "Describe it."),
             _prompt(folder, images[1:3], "Compare them.")]  # fmt: skip
    cpu, cuda = _llm(folder, "cpu"), _llm(folder, "cuda", enforce_eager)
    assert type(cuda.core.runner.backend) is TorchSDPABackend
    for ids, media in cases:
        expected = cpu.generate([ids], GREEDY, [media])[0].token_ids
        assert cuda.generate([ids], GREEDY, [media])[0].token_ids == expected
    batched = cuda.generate([c[0] for c in cases], GREEDY, [c[1] for c in cases])
    assert [r.token_ids for r in batched] == [
        cpu.generate([ids], GREEDY, [media])[0].token_ids for ids, media in cases
    ]
