"""The on-disk form of one KV block: a fixed prefix, a JSON header, the payload.

```
offset 0   magic  b"FKVB"
       4   u16    format version
       6   u16    reserved (0)
       8   u32    header length H
      12   u64    xxh3-64 over header + payload
      20   H      header: JSON {fingerprint, layout, dtype, block_size, block_hash, payload_bytes}
      20+H        payload: the block's bytes, layer by layer ([num_layers, block_size, width])
```

The header is fully determined by the tier's ``BlockMeta`` and the block hash, so a
reader compares it byte for byte with the one it expects; the checksum covers it and
the payload, so a flipped byte or a truncated file anywhere is ``CorruptBlock``.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass

import torch
import xxhash

from kvstore.hashing import BlockHash

MAGIC = b"FKVB"
VERSION = 1
_PREFIX = struct.Struct("<4sHHIQ")


class CorruptBlock(ValueError):
    """A block file whose bytes do not check out (bad magic, header, length or checksum)."""


@dataclass(frozen=True)
class BlockMeta:
    """What every block of one model's cache looks like: the header's fixed fields."""

    fingerprint: str  # the model's (engine.config.ModelConfig.fingerprint)
    num_layers: int
    block_size: int
    components: tuple[tuple[str, tuple[int, ...]], ...]  # (name, per-token shape)
    dtype: torch.dtype

    @functools.cached_property
    def token_width(self) -> int:
        width = 0
        for _, shape in self.components:
            n = 1
            for d in shape:
                n *= d
            width += n
        return width

    @functools.cached_property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.num_layers, self.block_size, self.token_width)

    @functools.cached_property
    def payload_bytes(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.block_size * self.token_width * item

    def describe(self) -> dict:
        return {
            "version": VERSION,
            "fingerprint": self.fingerprint,
            "layout": {
                "num_layers": self.num_layers,
                "components": [[name, list(shape)] for name, shape in self.components],
            },
            "dtype": str(self.dtype).removeprefix("torch."),
            "block_size": self.block_size,
        }

    @functools.cached_property
    def namespace(self) -> str:
        """Directory name shared by every file of this layout: files of another model,
        dtype or block size never collide with these (the hash does not cover dtype)."""
        text = json.dumps(self.describe(), sort_keys=True)
        return f"v{VERSION}-{xxhash.xxh3_64_hexdigest(text.encode())}"

    def header(self, block_hash: BlockHash) -> bytes:
        before, after = self._header_around_hash
        return before + block_hash.hex().encode() + after

    @functools.cached_property
    def _header_around_hash(self) -> tuple[bytes, bytes]:
        fields = {**self.describe(), "block_hash": "@", "payload_bytes": self.payload_bytes}
        text = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        before, _, after = text.partition(b'"@"')
        return before + b'"', b'"' + after


def pack(meta: BlockMeta, block_hash: BlockHash, block: torch.Tensor) -> list[bytes | memoryview]:
    """The file's bytes, as parts for one vectored write. ``block``: a CPU tensor of
    ``meta.block_shape`` and ``meta.dtype``."""
    if tuple(block.shape) != meta.block_shape or block.dtype != meta.dtype:
        raise ValueError(f"block {tuple(block.shape)} {block.dtype} does not match the tier")
    header = meta.header(block_hash)
    payload = memoryview(block.contiguous().view(torch.uint8).numpy()).cast("B")
    digest = xxhash.xxh3_64()
    digest.update(header)
    digest.update(payload)
    prefix = _PREFIX.pack(MAGIC, VERSION, 0, len(header), digest.intdigest())
    return [prefix, header, payload]


def file_size(meta: BlockMeta, block_hash: BlockHash) -> int:
    return _PREFIX.size + len(meta.header(block_hash)) + meta.payload_bytes


def unpack(meta: BlockMeta, block_hash: BlockHash, data: bytearray) -> torch.Tensor:
    """The block stored in ``data`` (a view on it, no copy), or ``CorruptBlock``."""
    if len(data) < _PREFIX.size:
        raise CorruptBlock(f"{len(data)} bytes: shorter than the prefix")
    magic, version, reserved, header_len, checksum = _PREFIX.unpack_from(data)
    if magic != MAGIC or version != VERSION or reserved:
        raise CorruptBlock(f"magic {magic!r} version {version} reserved {reserved}")
    header = meta.header(block_hash)
    start = _PREFIX.size + len(header)
    if header_len != len(header) or len(data) != start + meta.payload_bytes:
        raise CorruptBlock(f"{len(data)} bytes, header {header_len}: not this block's size")
    view = memoryview(data)
    if view[_PREFIX.size : start] != header:
        raise CorruptBlock("header does not describe this block")
    if xxhash.xxh3_64_intdigest(view[_PREFIX.size :]) != checksum:
        raise CorruptBlock("checksum mismatch")
    raw = torch.frombuffer(data, dtype=torch.uint8, offset=start, count=meta.payload_bytes)
    return raw.view(meta.dtype).view(meta.block_shape)
