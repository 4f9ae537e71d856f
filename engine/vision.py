"""Images for a vision-language model: decoding, the model's own image processor, and the
tower that turns them into embeddings.

- ``decode_image`` reads an image file with Pillow and checks it before its pixels are
  decoded (format, pixel count from the header: a decompression bomb is refused
  unread), then decodes it whole (a truncated file is refused) and makes it RGB the way
  transformers does (transparency composited onto white). Every failure is an
  ``ImageError``, whose message a client can be shown.
- ``ImageProcessor`` is transformers' ``Qwen2VLImageProcessorPil`` (resize to a multiple
  of ``patch_size * merge_size`` within ``min_pixels .. max_pixels``, rescale, normalise,
  cut into patches), built from the model's ``preprocessor_config.json`` settings (the
  Pillow backend: no torchvision). It also says, from an image's size alone, how many
  placeholder tokens the image takes (``grid``, ``num_tokens``) and what its content hash
  is (``content_hash``: sha256 over the settings and the RGB pixels, so the same picture
  in another file format hashes alike and a processor change never reuses an old entry).
- ``VisionEncoder``: decode + process + the tower (``engine.models.qwen2_5_vl``) for a
  batch of images at once; one embedding row per placeholder token.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from engine.messages import MediaItem
    from engine.models.qwen2_5_vl import VisionTransformer

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what decode_image takes
MAX_ASPECT_RATIO = 200  # the processor's own bound on long side / short side
# A worker's own bound on an image it decodes: frontends refuse images past their (lower)
# limit before a worker sees them.
MAX_DECODE_PIXELS = 1 << 28

Grid = tuple[int, int, int]  # time, height, width, in patches


class ImageError(ValueError):
    """An image that cannot be used; the message says why."""


@dataclass(frozen=True)
class DecodedImage:
    """An image's RGB pixels [H, W, 3] uint8 and the file format it came in."""

    pixels: np.ndarray
    format: str

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])


def decode_image(data: bytes, max_pixels: int) -> DecodedImage:
    """The RGB pixels of the image file ``data``; ``ImageError`` when it is not an image
    Pillow can decode, not one of ``FORMATS``, larger than ``max_pixels`` pixels (read
    from the header, before decoding), truncated or damaged."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, Image.DecompressionBombWarning,
            Image.DecompressionBombError, OSError, ValueError, SyntaxError) as exc:  # fmt: skip
        if "truncated" in str(exc).lower():  # cut short before its header ended
            raise ImageError(f"the image data is truncated or damaged ({_why(exc)})") from None
        raise ImageError(f"the data is not an image Pillow can read ({_why(exc)})") from None
    with image:
        if image.format not in FORMATS:
            raise ImageError(f"image format {image.format or 'unknown'} is not supported "
                             f"(send {', '.join(FORMATS)})")  # fmt: skip
        width, height = image.size
        if width < 1 or height < 1:
            raise ImageError(f"the image is {width}x{height} pixels")
        check_pixels(width, height, max_pixels)
        if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
            raise ImageError(f"the image is {width}x{height}: its sides may differ by a "
                             f"factor of {MAX_ASPECT_RATIO} at most")  # fmt: skip
        try:
            image.load()
            pixels = _rgb(image)
        except (OSError, ValueError, SyntaxError, EOFError) as exc:  # truncated, damaged
            raise ImageError(f"the image data is truncated or damaged ({_why(exc)})") from None
        return DecodedImage(np.ascontiguousarray(pixels, dtype=np.uint8), image.format)


def check_pixels(width: int, height: int, max_pixels: int) -> None:
    """``ImageError`` when a ``width`` x ``height`` image has more than ``max_pixels``."""
    if width * height > max_pixels:
        raise ImageError(f"the image is {width}x{height} = {width * height} pixels; "
                         f"at most {max_pixels} are accepted")  # fmt: skip


def _rgb(image: Any) -> np.ndarray:
    """An image's RGB pixels as transformers' image processors make them (transparency
    composited over white), with Pillow alone: their helper's arguments differ between
    transformers releases."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.asarray(image.convert("RGB"))


def _why(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


# Settings of Qwen2.5-VL's preprocessor_config.json that change what the processor makes.
_SETTINGS = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
             "image_mean", "image_std", "rescale_factor", "do_rescale", "do_normalize",
             "do_resize", "resample")  # fmt: skip

QWEN2_5_VL_DEFAULTS: dict[str, Any] = {
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 16384,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


class ImageProcessor:
    """transformers' image processor of the model, with the settings given (those of its
    ``preprocessor_config.json``; ``size`` or ``min_pixels``/``max_pixels`` for the
    resize bounds)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        settings = dict(settings)
        size = settings.pop("size", None) or {}
        defaults = QWEN2_5_VL_DEFAULTS
        settings.setdefault("min_pixels", size.get("shortest_edge", defaults["min_pixels"]))
        settings.setdefault("max_pixels", size.get("longest_edge", defaults["max_pixels"]))
        kept = {k: settings[k] for k in _SETTINGS if k in settings}
        self._processor = Qwen2VLImageProcessorPil(**kept)
        proc = self._processor
        self.patch_size = int(proc.patch_size)
        self.merge_size = int(proc.merge_size)
        self.temporal_patch_size = int(proc.temporal_patch_size)
        self.min_pixels = int(proc.size["shortest_edge"])
        self.max_pixels = int(proc.size["longest_edge"])
        described = {k: v for k, v in proc.to_dict().items() if k != "image_processor_type"}
        self.key = json.dumps(described, sort_keys=True, default=str).encode()

    def grid(self, width: int, height: int) -> Grid:
        """The patch grid of a ``width`` x ``height`` image, as the processor resizes it."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        h, w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        return (1, h // self.patch_size, w // self.patch_size)

    def num_tokens(self, grid: Grid) -> int:
        """Placeholder tokens of an image with this grid (one per merged square)."""
        return grid[0] * grid[1] * grid[2] // self.merge_size**2

    def content_hash(self, image: DecodedImage) -> bytes:
        """sha256 over the processor's settings, the size and the RGB pixels."""
        h = hashlib.sha256(b"ferry-image-1\0")
        h.update(self.key)
        h.update(f"\0{image.width}x{image.height}\0".encode())
        h.update(image.pixels.tobytes())
        return h.digest()

    def patches(self, images: Sequence[DecodedImage]) -> tuple[np.ndarray, list[Grid]]:
        """The processor's output for ``images``: patches [N, patch_width] float32 of all
        of them in order, and each image's grid."""
        out = self._processor(images=[i.pixels for i in images], return_tensors="np")
        grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"]]
        return np.ascontiguousarray(out["pixel_values"], dtype=np.float32), grids


@dataclass(frozen=True)
class ImageInputs:
    """What a frontend needs to put images into a model's prompts: its image processor
    and the placeholder token its chat template writes for an image."""

    processor: ImageProcessor
    image_token_id: int


@dataclass(frozen=True)
class ImageInput:
    """An image checked and measured for a prompt: its file, content hash and grid, and
    how many placeholder tokens it takes there."""

    data: bytes
    content_hash: bytes
    grid: Grid
    num_tokens: int
    format: str


def prepare_image(processor: ImageProcessor, data: bytes, max_pixels: int) -> ImageInput:
    """Decode and check ``data`` (``decode_image``), hash and measure it for ``processor``."""
    return measure_image(processor, data, decode_image(data, max_pixels))


def measure_image(processor: ImageProcessor, data: bytes, image: DecodedImage) -> ImageInput:
    """``image`` (decoded from the file ``data``) hashed and measured for ``processor``."""
    grid = processor.grid(image.width, image.height)
    return ImageInput(data, processor.content_hash(image), grid, processor.num_tokens(grid),
                      image.format)  # fmt: skip


def place_images(
    token_ids: Sequence[int], image_token_id: int, images: Sequence[ImageInput]
) -> tuple[list[int], list[MediaItem]]:
    """The prompt with each single image placeholder (as the chat template writes it)
    widened to its image's token count, and the images as ``MediaItem``s (with their
    files). ``ImageError`` when the prompt has not one placeholder per image."""
    from engine.messages import MediaItem

    at = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(at) != len(images):
        raise ImageError(f"the prompt has {len(at)} image placeholders for {len(images)} "
                         "images (is there a placeholder in the text, or does the chat "
                         "template drop images?)")  # fmt: skip
    out: list[int] = []
    media = []
    last = 0
    for where, image in zip(at, images):
        out += token_ids[last:where]
        media.append(MediaItem(image.content_hash, len(out), image.num_tokens, image.grid,
                               image.data))  # fmt: skip
        out += [image_token_id] * image.num_tokens
        last = where + 1
    out += token_ids[last:]
    return out, media


class VisionEncoder:
    """Image files → embeddings, on the tower's device and in its dtype."""

    def __init__(self, tower: VisionTransformer, processor: ImageProcessor, max_pixels: int):
        self.tower = tower
        self.processor = processor
        self.max_pixels = max_pixels

    @property
    def hidden_size(self) -> int:
        return self.tower.config.out_hidden_size

    def encode(self, images: Sequence[bytes]) -> list[torch.Tensor]:
        """One [num_tokens, hidden] tensor per image (``ImageError`` for a bad one): all of
        them through the tower in one forward."""
        return self.encode_decoded([decode_image(d, self.max_pixels) for d in images])

    def encode_decoded(self, images: Sequence[DecodedImage]) -> list[torch.Tensor]:
        import torch

        if not images:
            return []
        patches, grids = self.processor.patches(images)
        with torch.inference_mode():
            out = self.tower(torch.from_numpy(patches), grids)
        return list(out.split([self.processor.num_tokens(g) for g in grids]))
