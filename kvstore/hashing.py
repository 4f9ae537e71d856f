"""The one block hash of ferry.

A block's key is a 128-bit xxh3 digest over the parent block's digest, the block's
token ids as little-endian uint32, and extra keys (model fingerprint, cache salt,
multimodal content hashes). The same input yields the same key in every process,
on every host, after every restart: nothing here depends on Python's ``hash()``.

An image's tokens are copies of one placeholder id, so the tokens alone cannot tell two
images apart: a block that holds any token of a media span (``MediaSpan``: first token,
end, content hash) has that span's content hash in its extra keys (``block_extra``), and
since blocks chain, so does every block after it. Two prompts with different images then
share no block from the first image token on; the same image in the same place shares
them all.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

BlockHash = bytes  # 16 bytes
MediaSpan = tuple[int, int, bytes]  # tokens [start, end) of one image, its content hash

ROOT_HASH: BlockHash = b"\x00" * 16


def block_hash(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Digest of one block chained to its parent's digest."""
    h = xxhash.xxh3_128()
    h.update(parent)
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    if extra:
        h.update(len(extra).to_bytes(4, "little"))
        h.update(extra)
    return h.digest()


def block_extra(extra: bytes, media: Sequence[MediaSpan], start: int, end: int) -> bytes:
    """The extra keys of the block of tokens ``[start, end)``: ``extra``, then the content
    hash of every media span that overlaps the block, in order."""
    inside = [digest for first, last, digest in media if first < end and last > start]
    return extra + extra_keys(*inside) if inside else extra


def hash_chain(
    token_ids: Sequence[int], block_size: int, extra: bytes = b"", parent: BlockHash = ROOT_HASH,
    media: Sequence[MediaSpan] = (),
) -> list[BlockHash]:  # fmt: skip
    """Digests of every *full* block of ``token_ids``, each chained to the one before
    (``media``: the prompt's images, whose hashes enter their blocks' extra keys)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        keys = block_extra(extra, media, start, end) if media else extra
        parent = block_hash(parent, token_ids[start:end], keys)
        hashes.append(parent)
    return hashes


def extra_keys(*parts: str | bytes | None) -> bytes:
    """Pack extra hash inputs (model fingerprint, cache salt, ...) into one byte string."""
    out = bytearray()
    for part in parts:
        if part is None:
            continue
        data = part.encode() if isinstance(part, str) else part
        out += len(data).to_bytes(4, "little") + data
    return bytes(out)
