"""Qwen2.5-VL against transformers on the same weights (CPU, float32).

The checkpoint is a tiny random one that transformers writes (``hf_models.write_tiny_vlm``:
3 vision blocks, window attention in windows of 2 x 2 merged squares with one
full-attention block, 2x2 merging; a 2-layer Qwen2 with M-RoPE sections 2, 3, 3), with
a byte tokenizer carrying Qwen's special tokens, Qwen2.5-VL's chat template and
transformers' image processor. Images are random pixels of different sizes, so that
windows are partial and grids differ. Metric: ``relative_error`` = max |ours - theirs| /
max |theirs|; the bound is 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import SequenceRunner, relative_error, single_sequence_metadata
from hf_models import VL_IMAGE_TOKEN, VL_PROCESSOR, random_image, vl_reference, write_tiny_vlm

from engine.attention.base import ForwardContext
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm import LLM
from engine.loader import load_image_processor, load_model, load_vision_model
from engine.models.base import Spliced
from engine.sampling_params import SamplingParams
from engine.vision import decode_image, place_images, prepare_image
from kvstore.hashing import hash_chain

TOLERANCE = 1e-4
NEW_TOKENS = 24
MAX_PIXELS = 1 << 24
SIZES = [(130, 100), (90, 150), (200, 120)]  # (width, height): grids 8x10, 10x6, 8x12...

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def ref(folder):
    return vl_reference()


@pytest.fixture(scope="module")
def ours(folder):
    return load_model(str(folder), progress=False)


@pytest.fixture(scope="module")
def images():
    return [random_image(i, w, h) for i, (w, h) in enumerate(SIZES)]


def _prompt(ours, images: list[bytes], text: str = "Describe these.") -> tuple[list[int], list]:
    """The chat prompt with ``images`` before ``text``, placeholders widened."""
    processor = load_image_processor(str(ours.path))
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    rendered = ours.tokenizer.apply_chat_template([{"role": "user", "content": parts}])
    ids = ours.tokenizer.encode(rendered)
    prepared = [prepare_image(processor, data, MAX_PIXELS) for data in images]
    return place_images(ids, VL_IMAGE_TOKEN, prepared)


def _pixels(images: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' processor on the PIL images (the reference's input)."""
    import io

    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    out = Qwen2VLImageProcessorPil(**VL_PROCESSOR)(
        images=[Image.open(io.BytesIO(d)) for d in images], return_tensors="pt"
    )
    return out["pixel_values"], out["image_grid_thw"]


def _reference_inputs(ids: list[int], images: list[bytes]) -> dict:
    pixels, grid = _pixels(images)
    input_ids = torch.tensor([ids])
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                pixel_values=pixels, image_grid_thw=grid,
                mm_token_type_ids=(input_ids == VL_IMAGE_TOKEN).int())  # fmt: skip


@torch.no_grad()
def _our_logits(ours, ids: list[int], media: list, chunks: list[int]) -> torch.Tensor:
    """Logits of the prompt run through the paged cache in ``chunks`` (sizes)."""
    model = ours.model
    embeds = [model.visual(torch.from_numpy(p), g) for p, g in
              (load_image_processor(str(ours.path)).patches([decode_image(m.data, MAX_PIXELS)])
               for m in media)]  # fmt: skip
    table = model.rope_table(len(ids), media)
    runner = SequenceRunner(model, len(ids))
    out, start = [], 0
    for size in chunks:
        end = start + size
        meta = single_sequence_metadata(start, size, runner.block_table, runner.block_size)
        rows, values = [], []
        for item, emb in zip(media, embeds):
            lo, hi = max(item.offset, start), min(item.end, end)
            if lo < hi:
                rows.append(torch.arange(lo, hi) - start)
                values.append(emb[lo - item.offset : hi - item.offset])
        spliced = Spliced(torch.cat(rows), torch.cat(values)) if rows else None
        positions = torch.from_numpy(table.positions(start, end))
        hidden = model(torch.tensor(ids[start:end]), positions,
                       ForwardContext(meta, runner.backend), spliced)  # fmt: skip
        out.append(model.compute_logits(hidden))
        start = end
    return torch.cat(out)


def test_config_reads_the_vision_tower_and_the_m_rope_sections(ours):
    vision = ours.config.vision
    assert ours.config.architecture == "qwen2_5_vl" and ours.config.attention_bias
    assert ours.config.mrope_section == (2, 3, 3)
    assert (vision.depth, vision.hidden_size, vision.num_heads) == (3, 32, 2)
    assert (vision.window_size, vision.fullatt_block_indexes) == (56, (1,))
    assert vision.image_token_id == VL_IMAGE_TOKEN
    assert vision.fingerprint in ours.config.fingerprint


def test_vision_tower_matches_transformers_for_one_and_two_images(ref, folder, images):
    tower = load_vision_model(str(folder), progress=False).tower
    for batch in (images[:1], images[1:3]):
        pixels, grid = _pixels(batch)
        with torch.no_grad():
            theirs = ref.model.visual(pixels, grid_thw=grid).pooler_output
            mine = tower(pixels, [tuple(g) for g in grid.tolist()])
        assert mine.shape == theirs.shape
        assert relative_error(mine, theirs) <= TOLERANCE


def test_only_the_tower_weights_are_read_for_an_encode_worker(folder, ours):
    vision = load_vision_model(str(folder), progress=False)
    assert sum(p.numel() for p in vision.tower.parameters()) == sum(
        p.numel() for p in ours.model.visual.parameters()
    )
    text_only = load_model(str(folder), progress=False, vision=False)
    assert text_only.model.visual is None


def test_positions_are_transformers_rope_index(ref, ours, images):
    ids, media = _prompt(ours, images[:2])
    inputs = _reference_inputs(ids, images[:2])
    expected, delta = ref.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    table = ours.model.rope_table(len(ids), media)
    assert np.array_equal(table.prompt, expected[:, 0].numpy())
    assert table.delta == int(delta) and table.linear_from == media[-1].end


@pytest.mark.parametrize("count", [1, 2])
def test_logits_with_images_match_transformers(ref, ours, images, count):
    ids, media = _prompt(ours, images[:count])
    with torch.no_grad():
        theirs = ref(**_reference_inputs(ids, images[:count])).logits[0]
    whole = _our_logits(ours, ids, media, [len(ids)])
    assert relative_error(whole, theirs) <= TOLERANCE
    # chunks that cut through an image: a chunk holds part of its placeholders
    cut = media[0].offset + media[0].length // 2
    chunked = _our_logits(ours, ids, media, [cut, 7, len(ids) - cut - 7])
    assert relative_error(chunked, theirs) <= TOLERANCE


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(EngineConfig(
        model=str(folder), num_threads=1, cache=CacheConfig(block_size=16, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    ))  # fmt: skip


def _reference_generate(ref, ids: list[int], images: list[bytes]) -> list[int]:
    with torch.inference_mode():
        out = ref.generate(**_reference_inputs(ids, images), max_new_tokens=NEW_TOKENS,
                           do_sample=False)  # fmt: skip
    return out[0, len(ids) :].tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_greedy_generation_with_images_matches_transformers_generate(ref, ours, llm, images):
    cases = [_prompt(ours, images[:1]), _prompt(ours, images[1:3], "Compare them.")]
    expected = [_reference_generate(ref, ids, imgs)
                for (ids, _), imgs in zip(cases, [images[:1], images[1:3]])]  # fmt: skip
    llm.core.kv.pool.reset_prefix_cache()
    alone = [llm.generate([ids], GREEDY, [media])[0].token_ids for ids, media in cases]
    assert alone == expected
    llm.core.kv.pool.reset_prefix_cache()  # both at once, prefilled in 64-token chunks
    batched = llm.generate([c[0] for c in cases], GREEDY, [c[1] for c in cases])
    assert [r.token_ids for r in batched] == expected
    llm.core.check_integrity()


def test_the_same_image_hits_the_prefix_cache_and_answers_the_same(ours, llm, images):
    ids, media = _prompt(ours, images[:1])
    llm.core.kv.pool.reset_prefix_cache()
    first = llm.generate([ids], GREEDY, [media])[0]
    again = llm.generate([ids], GREEDY, [media])[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(ids) - 1) // 16 * 16 > media[0].end
    assert again.token_ids == first.token_ids


def test_different_images_share_no_block_from_the_first_image_token(ours, images):
    other = random_image(7, *SIZES[0])  # the size of images[0], other pixels
    (a, media_a), (b, media_b) = _prompt(ours, [images[0]]), _prompt(ours, [other])
    assert media_a[0].grid == media_b[0].grid and a == b  # same tokens, other pixels
    spans = [[(m.offset, m.end, m.content_hash) for m in media] for media in (media_a, media_b)]
    chain_a, chain_b = (hash_chain(a, 16, b"x", media=s) for s in spans)
    first_image_block = media_a[0].offset // 16
    assert chain_a[:first_image_block] == chain_b[:first_image_block]
    assert not set(chain_a[first_image_block:]) & set(chain_b[first_image_block:])
    assert hash_chain(a, 16, b"x", media=spans[0]) == chain_a  # deterministic


def test_a_request_with_given_embeddings_answers_as_one_encoded_here(ours, llm, images, folder):
    ids, media = _prompt(ours, images[:1])
    llm.core.kv.pool.reset_prefix_cache()
    encoded_here = llm.generate([ids], GREEDY, [media])[0].token_ids
    text_only = LLM(EngineConfig(model=str(folder), num_threads=1, vision=False,
                                 cache=CacheConfig(block_size=16, num_blocks=64)))  # fmt: skip
    assert text_only.core.media.encoder is None
    embeddings = llm.core.media.encoder.encode([m.data for m in media])
    from engine.messages import EngineRequest

    request = EngineRequest("given", ids, GREEDY, media=[m.without_data() for m in media])
    assert text_only.core.add_request(request, embeddings) is None
    tokens = []
    while text_only.core.has_work:
        tokens += [t for out in text_only.core.step() for t in out.new_token_ids]
    assert tokens == encoded_here
    refused = text_only.core.add_request(EngineRequest("files", ids, GREEDY, media=media))
    assert refused is not None and "no vision encoder" in refused.error
