"""Workloads: what the load generator sends, built up front and deterministic under a seed.

A workload is a list of ``Session``s. A session is a sequence of ``Turn``s sent one after
another on one conversation: before each turn the client waits ``think_time_s``, appends
the turn's ``messages`` to the conversation, sends the whole conversation, and appends
the model's answer as an assistant message. Single-request workloads are sessions of
one turn, so every workload runs through the same code.

Lengths are counted in words drawn from a list of short common English words; each is
about one token for byte-level BPE tokenizers (the server's ``usage.prompt_tokens``
reports the exact count).

The ``images`` workload sends one user message per request: its words first, then
``images_per_request`` generated PNG images (random pixels, ``image_width`` x
``image_height``, as OpenAI ``image_url`` data URLs). Image ``j`` of request ``i`` is
drawn from ``(image_seed, i, j)`` alone: two runs with the same ``image_seed`` send the
same images (a warm embedding cache) and, with another ``seed``, different words in
front of them (no prompt prefix to reuse past the words); a new ``image_seed`` sends
images no server has seen (a cold cache). PNGs are written here (zlib), without Pillow.
"""

from __future__ import annotations

import base64
import json
import random
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

SYNTHETIC = ("random", "shared-prefix", "multiturn", "images")
ENDPOINTS = ("chat", "responses")  # where the conversations go (LoadConfig.endpoint)

_WORD_TEXT = """the of and to in is it you that he was for on are with as his they be at one have
    this from or had by hot word but what some we can out other were all there when up use
    your how said an each she which do their time if will way about many then them write
    would like so these her long make thing see him two has look more day could go come did
    number sound no most people my over know water than call first who may down side been
    now find any new work part take get place made live where after back little only round
    man year came show every good me give our under name very through just form sentence
    great think say help low line differ turn cause much mean before move right boy old too
    same tell does set three want air well also play small end put home read hand port large
    spell add even land here must big high such follow act why ask men change went light
    kind off need house picture try us again animal point mother world near build self earth
    father head stand own page should country found answer school grow study still learn
    plant cover food sun four between state keep eye never last let thought city tree cross
    farm hard start might story saw far sea draw left late run while press close night real
    life few north open seem together next white children begin got walk example ease paper
    group always music those both mark often letter until mile river car feet care second
    book carry took science eat room friend began idea fish mountain stop once base hear
    horse cut sure watch color face wood main enough plain girl usual young ready above ever
    red list though feel talk bird soon body dog family direct pose leave song measure door
    product black short numeral class wind question happen complete ship area half rock
    order fire south problem piece told knew pass since top whole king space heard best hour
    better true during hundred five remember step early hold west ground interest reach fast
    verb sing listen six table travel less morning ten simple several vowel toward war lay
    against pattern slow center love person money serve appear road map rain rule govern
    pull cold notice voice unit power town fine certain fly fall lead cry dark machine note
    wait plan figure star box noun field rest correct able pound done beauty drive stood"""
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class Turn:
    """One request of a session.

    ``messages`` are appended to the conversation before sending; ``max_tokens`` is the
    output length asked for (None: the server's default); ``extra`` holds further body
    fields (from a JSONL trace) that override the generator's defaults.
    """

    messages: tuple[Mapping[str, Any], ...]
    max_tokens: int | None
    think_time_s: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Session:
    """Turns sent in order on one conversation (one simulated user)."""

    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. ``kind`` is one of SYNTHETIC or a path to a JSONL file.

    Input lengths are uniform in ``[input_len * (1 - range_ratio), input_len * (1 +
    range_ratio)]``; output lengths are exactly ``output_len`` (the server is asked to
    ignore EOS). shared-prefix: ``num_prefixes`` system prompts of ``prefix_len`` words,
    each request one of them plus an ``input_len``-word question. multiturn: sessions of
    ``turns`` turns, each new user message ``input_len`` words, think time exponential
    with mean ``think_time_s`` before every turn after the first.
    """

    kind: str
    num_requests: int
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    seed: int = 0
    num_prefixes: int = 4
    prefix_len: int = 512
    turns: int = 4
    think_time_s: float = 0.5
    image_width: int = 448
    image_height: int = 448
    images_per_request: int = 1
    image_seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        if self.num_prefixes < 1 or self.turns < 1 or self.think_time_s < 0:
            raise ValueError("num_prefixes and turns must be >= 1, think_time_s >= 0")
        if min(self.image_width, self.image_height, self.images_per_request) < 1:
            raise ValueError("image sides and images_per_request must be >= 1")


def build_sessions(spec: WorkloadSpec) -> list[Session]:
    """Sessions holding exactly ``spec.num_requests`` turns in all; same spec, same output."""
    rng = random.Random(spec.seed)
    if spec.kind == "random":
        return [_single(_user(_words(rng, _length(rng, spec))), spec) for _ in _n(spec)]
    if spec.kind == "shared-prefix":
        return _shared_prefix(rng, spec)
    if spec.kind == "multiturn":
        return _multiturn(rng, spec)
    if spec.kind == "images":
        return [_single(_image_message(rng, spec, i), spec) for i in _n(spec)]
    return _from_jsonl(Path(spec.kind), spec)


def count_requests(sessions: list[Session]) -> int:
    return sum(len(s.turns) for s in sessions)


def _n(spec: WorkloadSpec) -> range:
    return range(spec.num_requests)


def _length(rng: random.Random, spec: WorkloadSpec) -> int:
    low = max(1, round(spec.input_len * (1 - spec.range_ratio)))
    high = max(low, round(spec.input_len * (1 + spec.range_ratio)))
    return rng.randint(low, high)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(_WORDS, k=n))


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _single(message: Mapping[str, Any], spec: WorkloadSpec, *more: Mapping) -> Session:
    return Session((Turn(messages=(*more, message), max_tokens=spec.output_len),))


def _image_message(rng: random.Random, spec: WorkloadSpec, i: int) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": _words(rng, _length(rng, spec))}]
    for j in range(spec.images_per_request):
        seed = f"{spec.image_seed}/{i}/{j}"
        png = random_png(spec.image_width, spec.image_height, seed)
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return {"role": "user", "content": parts}


def random_png(width: int, height: int, seed: int | str) -> bytes:
    """An RGB PNG of random pixels, the same for the same arguments."""
    pixels = random.Random(seed).randbytes(width * height * 3)
    stride = width * 3
    rows = b"".join(b"\0" + pixels[y * stride : (y + 1) * stride] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 1))
            + chunk(b"IEND", b""))  # fmt: skip


def _shared_prefix(rng: random.Random, spec: WorkloadSpec) -> list[Session]:
    systems = [
        {"role": "system", "content": f"Group {g}. " + _words(rng, spec.prefix_len)}
        for g in range(spec.num_prefixes)
    ]
    sessions = []
    for _ in _n(spec):
        system = systems[rng.randrange(spec.num_prefixes)]
        sessions.append(_single(_user(_words(rng, _length(rng, spec))), spec, system))
    return sessions


def _multiturn(rng: random.Random, spec: WorkloadSpec) -> list[Session]:
    sessions, left = [], spec.num_requests
    while left > 0:
        n = min(spec.turns, left)
        turns = tuple(
            Turn(
                messages=(_user(_words(rng, _length(rng, spec))),),
                max_tokens=spec.output_len,
                think_time_s=rng.expovariate(1 / spec.think_time_s)
                if i and spec.think_time_s
                else 0.0,
            )
            for i in range(n)
        )
        sessions.append(Session(turns))
        left -= n
    return sessions


def _from_jsonl(path: Path, spec: WorkloadSpec) -> list[Session]:
    """One session per line (an OpenAI chat request body), cycled to ``num_requests``.

    ``model``, ``stream`` and ``stream_options`` are the generator's; the other fields are
    kept. A body without ``max_tokens``/``max_completion_tokens`` gets ``output_len``.
    """
    bodies = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not bodies:
        raise ValueError(f"{path}: no requests")
    for i, body in enumerate(bodies):
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise ValueError(f"{path}:{i + 1}: not a chat request (no 'messages' list)")
    return [_trace_session(bodies[i % len(bodies)], spec) for i in _n(spec)]


def _trace_session(body: dict[str, Any], spec: WorkloadSpec) -> Session:
    extra = {
        k: v
        for k, v in body.items()
        if k not in ("messages", "model", "stream", "stream_options", "max_tokens")
    }
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or spec.output_len
    extra.pop("max_completion_tokens", None)
    turn = Turn(tuple(body["messages"]), max_tokens, extra=MappingProxyType(extra))
    return Session((turn,))
