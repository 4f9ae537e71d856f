"""The key/value header of a GGUF file, parsed without torch or the ``gguf`` package.

A frontend needs only this (the tokenizer and the model's name live there), so it can
start without importing torch: a few hundred milliseconds for the default model's 49k
tokens and 49k merges, against seconds for ``gguf.GGUFReader``. Tensors are in
``engine.loader.gguf``.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, struct.Struct] = {
    0: struct.Struct("<B"),
    1: struct.Struct("<b"),
    2: struct.Struct("<H"),
    3: struct.Struct("<h"),
    4: struct.Struct("<I"),
    5: struct.Struct("<i"),
    6: struct.Struct("<f"),
    7: struct.Struct("<?"),
    10: struct.Struct("<Q"),
    11: struct.Struct("<q"),
    12: struct.Struct("<d"),
}
_NUMPY_TYPES: dict[int, str] = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4",
    6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8",
}  # fmt: skip
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class _Cursor:
    """Sequential little-endian reads over a buffer."""

    def __init__(self, buf: Any, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def scalar(self, fmt: struct.Struct) -> Any:
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def string(self) -> str:
        length = self.scalar(_U64)
        raw = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        buf, pos, out = self.buf, self.pos, []
        unpack = _U64.unpack_from
        for _ in range(count):
            (length,) = unpack(buf, pos)
            pos += 8
            out.append(bytes(buf[pos : pos + length]).decode("utf-8", errors="replace"))
            pos += length
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        return self.scalar(_SCALARS[vtype])

    def array(self) -> list[Any]:
        etype = self.scalar(_U32)
        count = self.scalar(_U64)
        if etype == _STRING:
            return self.strings(count)
        if etype == _ARRAY:
            return [self.array() for _ in range(count)]
        dtype = np.dtype(_NUMPY_TYPES[etype])
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * dtype.itemsize
        return values.tolist()


def read_header(buf: Any, path: Path | str = "") -> tuple[int, int, dict[str, Any], _Cursor]:
    """``(version, tensor_count, metadata, cursor after the metadata)`` of a GGUF buffer.
    Raises ``ValueError`` when it is not GGUF version 2 or 3."""
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cur = _Cursor(buf, 4)
    version = cur.scalar(_U32)
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} in {path}")
    tensor_count, kv_count = cur.scalar(_U64), cur.scalar(_U64)
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar(_U32))
    return version, tensor_count, metadata, cur


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Only the key/value metadata of a GGUF file."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return read_header(buf, path)[2]
