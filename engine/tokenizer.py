"""Tokenizers: text ↔ token ids, chat templates and incremental detokenization.

``Tokenizer`` wraps a Hugging Face ``tokenizers.Tokenizer`` built from a GGUF file's
metadata (byte-level BPE) or from a ``tokenizer.json``. ``ByteTokenizer`` is a
dependency-free stand-in for models with random weights: one token per UTF-8 byte.

Chat templates render the way transformers renders them: a sandboxed jinja2
environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, a ``tojson``
that does not escape HTML, ``strftime_now``, and the special tokens as variables.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# Token texts that end a turn, as llama.cpp collects them ("end of generation").
END_OF_TURN_TOKENS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<|return|>",
    "<|call|>",
)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre → (split regex or None for GPT-2's, split digits individually first)
_PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "smollm": (None, True),
    "starcoder": (None, True),
    "refact": (None, True),
    "gpt2": (None, False),
    "default": (None, False),
    "llama3": (_LLAMA3_SPLIT, False),
    "llama-v3": (_LLAMA3_SPLIT, False),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False),
    "dbrx": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
}
# Pre-tokenizer types whose reference tokenizers look a whole word up before merging.
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe"}
# Pre-tokenizer types whose reference tokenizers normalise text to NFC first (Qwen2).
_NFC = {"qwen2", "deepseek-r1-qwen"}

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


@cache
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    ``step(token_id)`` returns the text that became final with this token (possibly "");
    a UTF-8 character split across tokens is emitted once its last byte arrives. The
    concatenation of all deltas equals ``decode(all_ids)`` whenever that ends on a
    complete character.
    """

    def __init__(self, tokenizer: HFTokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer, token_id) or ""


def _template_environment() -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@cache
def _compile_template(source: str) -> Any:
    return _template_environment().from_string(source)


def _plain(value: Any) -> Any:
    """Template data as plain JSON-like types (pydantic models and dataclasses to dicts)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    return value


def _plain_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as dicts without their None-valued keys, as transformers passes them
    (templates test for a missing key, not for None)."""
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be mappings, got {message!r}")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


class Tokenizer:
    """Text ↔ ids for one model, plus its chat template.

    ``encode(text)`` does not add BOS unless ``add_special_tokens=True`` and the model
    asks for it (``add_bos``); a rendered chat prompt already holds its special tokens.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._byte_level = _is_byte_level(backend)
        self._special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self.eos_token_ids = self._find_eos_ids(extra_eos_token_ids)

    def _find_eos_ids(self, extra: Iterable[int]) -> tuple[int, ...]:
        ids: list[int] = []
        candidates = [self.eos_token_id, *extra]
        candidates += [self.backend.token_to_id(t) for t in END_OF_TURN_TOKENS]
        for token_id in candidates:
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
        return tuple(ids)

    # ---- ids and vocabulary -------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows (base vocabulary plus added tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self.backend.token_to_id(self.pad_token)

    @property
    def is_byte_level(self) -> bool:
        """True for byte-level BPE vocabularies (GPT-2's ``Ġ`` spelling of bytes)."""
        return self._byte_level

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._special_ids))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """``bos_token``/``eos_token``/``unk_token``/``pad_token`` that are set (template vars)."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary string of a token (byte-level spelling, e.g. ``Ġthe``)."""
        return self.backend.id_to_token(token_id)

    def piece_to_id(self, piece: str) -> int | None:
        return self.backend.token_to_id(piece)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    # ---- text ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token texts in it become their ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one generated sequence."""
        return IncrementalDetokenizer(self.backend, skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The decoded text of one token on its own (special tokens included; a partial
        UTF-8 character shows as U+FFFD)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (special tokens: their UTF-8 text)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and token_id not in self._special_ids:
            table = unicode_to_bytes()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return self.token_text(token_id).encode("utf-8")

    # ---- chat ---------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` to the prompt text the model expects.

        ``messages`` are mappings, pydantic models or dataclasses; keys whose value is
        None are dropped from each message. Variables visible to the template:
        ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the special
        tokens (``bos_token``...) and ``kwargs`` (which override the special tokens).
        Raises ``ValueError`` when the model has no template, ``jinja2.TemplateError``
        when the template rejects the conversation.
        """
        source = chat_template or self.chat_template
        if source is None:
            raise ValueError("this tokenizer has no chat template")
        documents = kwargs.pop("documents", None)
        variables = {**self.special_tokens_map, **_plain(kwargs)}
        return _compile_template(source).render(
            messages=_plain_messages(messages),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from ``tokenizer.ggml.*`` metadata of a GGUF file (``gpt2`` byte-level BPE)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise NotImplementedError(f"GGUF tokenizer model {kind!r} (supported: 'gpt2')")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        pre = meta.get("tokenizer.ggml.pre", "default")
        backend = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges", []), pre)
        _add_marked_tokens(backend, tokens, types)

        def token(key: str) -> str | None:
            token_id = meta.get(f"tokenizer.ggml.{key}")
            return None if token_id is None or token_id >= len(tokens) else tokens[token_id]

        eot = meta.get("tokenizer.ggml.eot_token_id")
        return cls(
            backend,
            bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"),
            unk_token=token("unknown_token_id"),
            pad_token=token("padding_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
            extra_eos_token_ids=() if eot is None else (int(eot),),
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face folder: ``tokenizer.json`` plus, when present,
        ``tokenizer_config.json``, ``chat_template.jinja`` and ``generation_config.json``."""
        path = Path(path)
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        backend.no_padding()
        backend.no_truncation()
        config = _read_json(path / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        gen = _read_json(path / "generation_config.json")
        eos = gen.get("eos_token_id", [])
        bos = _token_content(config.get("bos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = bos is not None and _post_processor_adds(backend, bos)
        # The post-processor adds BOS itself; ``encode`` adds it only through ``add_bos``.
        backend.post_processor = None
        return cls(
            backend,
            bos_token=bos,
            eos_token=_token_content(config.get("eos_token")),
            unk_token=_token_content(config.get("unk_token")),
            pad_token=_token_content(config.get("pad_token")),
            add_bos=bool(add_bos),
            chat_template=template,
            extra_eos_token_ids=eos if isinstance(eos, list) else [eos],
        )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _post_processor_adds(backend: HFTokenizer, bos: str) -> bool:
    bos_id = backend.token_to_id(bos)
    return bos_id is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]


def _is_byte_level(backend: HFTokenizer) -> bool:
    decoder = backend.decoder
    return decoder is not None and "ByteLevel" in decoder.__class__.__name__


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(
        vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
        ignore_merges=pre in _IGNORE_MERGES,
    )  # fmt: skip
    backend = HFTokenizer(model)
    split, digits = _PRE_TOKENIZERS.get(pre, (None, False))
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    if pre in _NFC:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_marked_tokens(backend: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens,
    so both are matched whole in text instead of being split by BPE."""
    alphabet = set(bytes_to_unicode().values())
    control = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, types, strict=False)
        if kind == _TOKEN_CONTROL and set(tok) <= alphabet
    ]
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(tokens, types, strict=False)
        if kind == _TOKEN_USER_DEFINED
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Qwen2-VL's and Qwen2.5-VL's chat template: ChatML, a default system message, and each
# image part (type image / image_url) as <|vision_start|><|image_pad|><|vision_end|>, the
# one placeholder the frontend widens to the image's token count.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")


class ByteTokenizer(Tokenizer):
    """One token per UTF-8 byte, for models with random weights.

    Ids 0-255 are the bytes; 256-259 are ``<|bos|>``, ``<|eos|>``, ``<|im_start|>`` and
    ``<|im_end|>`` (special). The chat template is ChatML. A model's larger vocabulary
    is covered by decoding any id ≥ 260 as byte ``id % 256``, so every sampled id has
    text; ``vocab_size`` is the model's. ``vision``: 260-262 are also
    ``VISION_TOKENS`` (special) and the template is ``QWEN2_VL_CHAT_TEMPLATE``.
    """

    SPECIAL = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")

    def __init__(self, vocab_size: int = 260, vision: bool = False) -> None:
        spelling = bytes_to_unicode()
        vocab = {spelling[b]: b for b in range(256)}
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        special = self.SPECIAL + (VISION_TOKENS if vision else ())
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t in special])  # fmt: skip
        self._num_base = 256 + len(special)  # ids of their own; above them, bytes again
        self._model_vocab_size = max(vocab_size, self._num_base)
        template = QWEN2_VL_CHAT_TEMPLATE if vision else _CHATML_TEMPLATE
        super().__init__(
            backend, bos_token="<|bos|>", eos_token="<|eos|>", chat_template=template,
            extra_eos_token_ids=(259,),
        )  # fmt: skip

    @property
    def vocab_size(self) -> int:
        return self._model_vocab_size

    def _base_id(self, token_id: int) -> int:
        return token_id if token_id < self._num_base else token_id % 256

    def id_to_piece(self, token_id: int) -> str | None:
        if not 0 <= token_id < self._model_vocab_size:
            return None
        return self.backend.id_to_token(self._base_id(token_id))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return super().decode([self._base_id(i) for i in ids], skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return super().token_text(self._base_id(token_id))

    def token_bytes(self, token_id: int) -> bytes:
        return super().token_bytes(self._base_id(token_id))

    def decode_stream(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return _ModuloDetokenizer(self.backend, skip_special_tokens, self._base_id)


class _ModuloDetokenizer(IncrementalDetokenizer):
    def __init__(self, tokenizer: HFTokenizer, skip_special_tokens: bool, base_id: Any) -> None:
        super().__init__(tokenizer, skip_special_tokens)
        self._base_id = base_id

    def step(self, token_id: int) -> str:
        return super().step(self._base_id(token_id))
