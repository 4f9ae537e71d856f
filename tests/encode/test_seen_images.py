"""The frontend's memory of image files it decoded (``encode.inputs.SeenImages``): a file
sent again is not decoded again and gets the same content hash; another file gets its
own; the limits hold on first sight and on every later one; the memory is bounded."""

from __future__ import annotations

import asyncio
import base64

import pytest
from hf_models import VL_PROCESSOR, random_image

import encode.inputs as inputs
from encode.inputs import ImageRef, MediaError, MediaLimits, SeenImages, load_images
from engine.vision import ImageError, ImageProcessor, prepare_image

PROCESSOR = ImageProcessor(VL_PROCESSOR)


@pytest.fixture
def decodes(monkeypatch):
    calls = []
    real = inputs.decode_image

    def counting(data, max_pixels):
        calls.append(len(data))
        return real(data, max_pixels)

    monkeypatch.setattr(inputs, "decode_image", counting)
    return calls


def _ref(data: bytes, i: int = 0) -> ImageRef:
    return ImageRef("data:image/png;base64," + base64.b64encode(data).decode(),
                    f"messages.0.content.{i}")  # fmt: skip


def test_a_repeated_image_is_decoded_once_and_keeps_its_key(decodes):
    seen = SeenImages()
    data = random_image(0, 130, 100)
    first = seen.prepare(PROCESSOR, data, 1 << 24)
    again = seen.prepare(PROCESSOR, data, 1 << 24)
    assert len(decodes) == 1 and (seen.decodes, seen.hits) == (1, 1)
    assert again == first
    assert first == prepare_image(PROCESSOR, data, 1 << 24)  # the key as defined without it


def test_another_image_gets_another_key(decodes):
    seen = SeenImages()
    a = seen.prepare(PROCESSOR, random_image(0, 130, 100), 1 << 24)
    b = seen.prepare(PROCESSOR, random_image(1, 130, 100), 1 << 24)
    assert len(decodes) == 2 and a.content_hash != b.content_hash
    # the same picture in another file format: another file, decoded on its own
    c = seen.prepare(PROCESSOR, random_image(0, 130, 100, "WEBP"), 1 << 24)
    assert len(decodes) == 3 and c.format == "WEBP"


def test_other_processor_settings_are_other_entries(decodes):
    seen = SeenImages()
    data = random_image(0, 130, 100)
    a = seen.prepare(PROCESSOR, data, 1 << 24)
    other = ImageProcessor({**VL_PROCESSOR, "max_pixels": 28 * 28 * 16})
    b = seen.prepare(other, data, 1 << 24)
    assert len(decodes) == 2 and a.content_hash != b.content_hash


def test_the_pixel_limit_holds_on_first_sight_and_after(decodes):
    seen = SeenImages()
    data = random_image(0, 130, 100)  # 13000 pixels
    with pytest.raises(ImageError, match="13000 pixels"):
        seen.prepare(PROCESSOR, data, 12000)
    assert len(seen) == 0  # a refused file is not remembered
    seen.prepare(PROCESSOR, data, 1 << 24)
    with pytest.raises(ImageError, match="13000 pixels"):
        seen.prepare(PROCESSOR, data, 12000)  # known, but past this call's limit
    assert len(decodes) == 2


def test_through_load_images_the_refusals_are_the_same_400s(decodes):
    seen = SeenImages()
    data = random_image(0, 130, 100)
    small = MediaLimits(max_image_pixels=12000)
    for _ in range(2):  # first sight, then with the file remembered under a larger limit
        with pytest.raises(MediaError) as err:
            asyncio.run(load_images([_ref(data)], PROCESSOR, small, seen))
        assert err.value.param == "messages.0.content.0" and "13000 pixels" in err.value.message
        asyncio.run(load_images([_ref(data)], PROCESSOR, MediaLimits(), seen))
    with pytest.raises(MediaError, match="larger than"):  # the byte cap comes first
        asyncio.run(load_images([_ref(data)], PROCESSOR, MediaLimits(max_image_bytes=100), seen))
    with pytest.raises(MediaError, match="Invalid image"):
        asyncio.run(load_images([_ref(data[:200])], PROCESSOR, MediaLimits(), seen))
    out = asyncio.run(load_images([_ref(data), _ref(data, 1)], PROCESSOR, MediaLimits(), seen))
    assert out[0] == out[1] and len(decodes) == 3  # two refused, one kept; then hits


def test_the_memory_is_bounded_least_recently_used_first_out(decodes):
    seen = SeenImages(max_entries=2)
    files = [random_image(i, 60, 60) for i in range(3)]
    seen.prepare(PROCESSOR, files[0], 1 << 24)
    seen.prepare(PROCESSOR, files[1], 1 << 24)
    seen.prepare(PROCESSOR, files[0], 1 << 24)  # 0 used last: 1 goes first
    seen.prepare(PROCESSOR, files[2], 1 << 24)
    assert len(seen) == 2 and len(decodes) == 3
    seen.prepare(PROCESSOR, files[0], 1 << 24)
    assert len(decodes) == 3
    seen.prepare(PROCESSOR, files[1], 1 << 24)
    assert len(decodes) == 4
    nothing = SeenImages(0)  # remembers nothing
    nothing.prepare(PROCESSOR, files[0], 1 << 24)
    nothing.prepare(PROCESSOR, files[0], 1 << 24)
    assert len(nothing) == 0 and len(decodes) == 6
