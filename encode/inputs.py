"""A chat request's images, from their ``image_url`` to checked images (the frontend).

What is read:

- ``data:image/<type>;base64,<payload>`` URLs: the payload must be strict base64 and at
  most ``max_image_bytes`` once decoded (measured before decoding it);
- ``http://`` and ``https://`` URLs only when the host is one of ``allowed_domains`` (or
  a subdomain of one): fetched with ``fetch_timeout_s`` for the whole response, no
  redirects followed, stopped as soon as more than ``max_image_bytes`` have come;
- ``file://`` never, nor anything else.

Each image is then decoded and checked (``engine.vision.prepare_image``: Pillow, the
formats, at most ``max_image_pixels`` pixels read from its header, truncated data
refused), hashed and measured for the model's processor, in a worker thread. An image
file seen before is not decoded again: ``SeenImages`` keeps, by the sha256 of the file's
bytes and the processor's settings, what its decoding found (content hash, size, grid,
tokens), bounded and least recently used first out; the pixel limit is checked against
the size it kept. Every
refusal is a ``MediaError`` whose message names the image (``messages.<i>.content.<j>``)
and says why: the client's 400.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from engine.vision import (
    FORMATS,
    ImageError,
    ImageInput,
    ImageProcessor,
    check_pixels,
    decode_image,
    measure_image,
)

DEFAULT_MAX_IMAGE_BYTES = 20 << 20
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
DEFAULT_MAX_IMAGES = 16
DEFAULT_FETCH_TIMEOUT_S = 10.0
DEFAULT_SEEN_IMAGES = 4096  # files whose decoding a frontend remembers (~250 bytes each)

_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),", re.IGNORECASE)


@dataclass(frozen=True)
class MediaLimits:
    """What a request's images may be (``ServerConfig`` holds the server's)."""

    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_images: int = DEFAULT_MAX_IMAGES  # per request
    allowed_domains: tuple[str, ...] = ()  # hosts whose http(s) URLs are fetched
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S

    def __post_init__(self) -> None:
        if min(self.max_image_bytes, self.max_image_pixels, self.max_images) < 1:
            raise ValueError("the image limits must be at least 1")
        if not self.fetch_timeout_s > 0:
            raise ValueError("the media fetch timeout must be positive")

    def allows_host(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == d or host.endswith("." + d) for d in self.allowed_domains)


class MediaError(ValueError):
    """A request's image cannot be used; ``param`` says which."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ImageRef:
    """One ``image_url`` of a request and where it sits (``param``)."""

    url: str
    param: str


@dataclass(frozen=True)
class _Seen:
    measured: ImageInput  # without the file (``data`` empty): the caller's bytes go back
    width: int
    height: int


class SeenImages:
    """What decoding an image file found, by the sha256 of its bytes and the processor's
    settings: an LRU of at most ``max_entries`` (each a few hundred bytes), safe to use
    from several threads. ``decodes`` and ``hits`` count what ``prepare`` did."""

    def __init__(self, max_entries: int = DEFAULT_SEEN_IMAGES) -> None:
        if max_entries < 0:
            raise ValueError("max_entries must not be negative")
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, _Seen] = OrderedDict()
        self._lock = threading.Lock()
        self.decodes = self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def prepare(self, processor: ImageProcessor, data: bytes, max_pixels: int) -> ImageInput:
        """``engine.vision.prepare_image``, without decoding a file seen before."""
        key = hashlib.sha256(b"ferry-file-1\0" + processor.key + b"\0")
        key.update(data)
        digest = key.digest()
        with self._lock:
            seen = self._entries.get(digest)
            if seen is not None:
                self._entries.move_to_end(digest)
                self.hits += 1
        if seen is None:
            image = decode_image(data, max_pixels)
            measured = dataclasses.replace(measure_image(processor, data, image), data=b"")
            seen = _Seen(measured, image.width, image.height)
            with self._lock:
                self.decodes += 1
                if self.max_entries:
                    self._entries[digest] = seen
                    while len(self._entries) > self.max_entries:
                        self._entries.popitem(last=False)
        else:
            check_pixels(seen.width, seen.height, max_pixels)  # this call's limit
        return dataclasses.replace(seen.measured, data=data)


async def load_images(
    refs: Sequence[ImageRef], processor: ImageProcessor, limits: MediaLimits,
    seen: SeenImages | None = None,
) -> list[ImageInput]:  # fmt: skip
    """The images ``refs`` point to, read, decoded (unless ``seen`` knows the file),
    checked, hashed and measured (in order). Raises ``MediaError`` at the first image
    that cannot be used."""
    if len(refs) > limits.max_images:
        raise MediaError(f"The request has {len(refs)} images; at most {limits.max_images} "
                         "are accepted per request.", "messages")  # fmt: skip
    files = [await read_image_url(ref, limits) for ref in refs]
    seen = seen if seen is not None else SeenImages(0)
    return await asyncio.to_thread(_prepare_all, refs, files, processor,
                                   limits.max_image_pixels, seen)  # fmt: skip


def _prepare_all(refs: Sequence[ImageRef], files: list[bytes], processor: ImageProcessor,
                 max_pixels: int, seen: SeenImages) -> list[ImageInput]:  # fmt: skip
    out = []
    for ref, data in zip(refs, files):
        try:
            out.append(seen.prepare(processor, data, max_pixels))
        except ImageError as exc:
            raise MediaError(f"Invalid image: {exc}.", ref.param) from None
    return out


async def read_image_url(ref: ImageRef, limits: MediaLimits) -> bytes:
    """The bytes of the image file ``ref.url`` names (see the module docstring)."""
    url = ref.url.strip()
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _read_data_url(url, ref.param, limits.max_image_bytes)
    if scheme in ("http", "https"):
        return await _fetch(url, ref.param, limits)
    if scheme == "file":
        raise MediaError("file:// image URLs are not read; send the image as a data URL.",
                         ref.param)  # fmt: skip
    raise MediaError("An image URL must be a data: URL (data:image/png;base64,...) or an "
                     "http(s) URL of an allowed host.", ref.param)  # fmt: skip


def _read_data_url(url: str, param: str, max_bytes: int) -> bytes:
    head = _DATA_URL.match(url)
    if head is None:
        raise MediaError("A data URL must look like data:image/png;base64,<data>.", param)
    mime = head["mime"].strip().lower()
    if not mime.startswith("image/"):
        raise MediaError(f"Unsupported media type {mime or 'none'!r} in the data URL: send an "
                         f"image ({', '.join(f.lower() for f in FORMATS)}).", param)  # fmt: skip
    if ";base64" not in head["params"].lower():
        raise MediaError("The image's data URL must be base64 (data:image/...;base64,...).", param)
    payload = url[head.end() :].strip()
    if len(payload) * 3 // 4 > max_bytes + 2:
        raise MediaError(f"The image is larger than {max_bytes} bytes.", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("The image's data URL holds invalid base64.", param) from None
    if len(data) > max_bytes:
        raise MediaError(f"The image is larger than {max_bytes} bytes.", param)
    if not data:
        raise MediaError("The image's data URL is empty.", param)
    return data


async def _fetch(url: str, param: str, limits: MediaLimits) -> bytes:
    import httpx

    host = urlsplit(url).hostname or ""
    if not limits.allows_host(host):
        raise MediaError(f"Image URLs of host {host!r} are not fetched (the server fetches "
                         "only from --allowed-media-domains; send the image as a data URL).",
                         param)  # fmt: skip
    try:
        async with asyncio.timeout(limits.fetch_timeout_s), httpx.AsyncClient(
            follow_redirects=False, timeout=limits.fetch_timeout_s, trust_env=False,
        ) as client, client.stream("GET", url) as response:  # fmt: skip
            if response.status_code != 200:
                raise MediaError(f"Fetching the image answered HTTP {response.status_code}.",
                                 param)  # fmt: skip
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > limits.max_image_bytes:
                    raise MediaError(f"The image is larger than {limits.max_image_bytes} "
                                     "bytes.", param)  # fmt: skip
    except TimeoutError:
        raise MediaError(f"Fetching the image took longer than {limits.fetch_timeout_s:g} s.",
                         param) from None  # fmt: skip
    except httpx.HTTPError as exc:
        raise MediaError(f"The image could not be fetched: {type(exc).__name__}.",
                         param) from None  # fmt: skip
    return bytes(data)
