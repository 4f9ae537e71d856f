"""The tokenizer built from GGUF metadata against transformers' tokenizer from the same file."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from engine.tokenizer import ByteTokenizer, Tokenizer

TEXTS = {
    "english": "Hello world! The quick brown fox jumps over the lazy dog.",
    "contractions": "It's they're we'll I'd you've SHE'LL",
    "code": 'def f(x: int) -> int:\n    """Square."""\n    return x ** 2  # done\n\n\n',
    "numbers": "Call 555-0123 at 10:45, pay $1,234.56 or 3.14159e10 by 2024-01-01",
    "emoji": "emoji 😀🎉 👍🏽 family 👨‍👩‍👧 ok",
    "cjk": "中文字符测试，日本語のテキスト。한국어 문장",
    "accents": "naïve café über Ångström façade",
    "whitespace": "   leading\t\ttabs   and   spaces   \n\n\n  \r\n trailing   ",
    "special_tokens": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "special_inline": "a<|endoftext|>b<|im_end|>c",
    "empty": "",
}

CONVERSATIONS = {
    "no_system": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi!", "name": None},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 🐍 and 日本."},
    ],
    "system_multi_turn": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Good morning"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "  spaced  \n"},
    ],
}


@pytest.fixture(scope="module")
def reference(default_gguf_path: Path):
    """transformers' tokenizer loaded from the default GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(default_gguf_path.parent), gguf_file=default_gguf_path.name
    )


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_encode_matches_transformers(smollm2_tokenizer, reference, text):
    assert smollm2_tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_decode_matches_transformers(smollm2_tokenizer, reference, text):
    ids = reference.encode(text, add_special_tokens=False)
    assert smollm2_tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids)


@pytest.mark.parametrize("text", [TEXTS["english"], TEXTS["code"], TEXTS["whitespace"]])
def test_plain_text_round_trips(smollm2_tokenizer, text):
    assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text


@pytest.mark.parametrize("messages", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
def test_chat_template_matches_transformers(smollm2_tokenizer, reference, messages):
    ours = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    theirs = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    no_prompt = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert no_prompt == reference.apply_chat_template(messages, tokenize=False)


def test_chat_prompt_tokens_match_transformers(smollm2_tokenizer, reference):
    messages = CONVERSATIONS["system_multi_turn"]
    ids = smollm2_tokenizer.encode(smollm2_tokenizer.apply_chat_template(messages))
    theirs = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert ids == theirs["input_ids"]
    assert ids[0] == smollm2_tokenizer.bos_token_id == 1


def test_special_ids_and_vocab(smollm2_tokenizer, reference):
    tok = smollm2_tokenizer
    assert tok.vocab_size == len(reference) == 49152
    assert tok.eos_token_ids[0] == 2
    assert tok.bos_token_id == 1 and tok.pad_token_id == 2
    assert set(reference.all_special_ids) <= set(tok.all_special_ids)
    assert tok.id_to_piece(2) == "<|im_end|>"
    assert tok.id_to_piece(tok.encode(" the")[0]) == "Ġthe"


def test_incremental_detokenization_handles_split_characters(smollm2_tokenizer):
    text = "Grüße 😀 日本語 👨‍👩‍👧 ok <|im_end|>done"
    ids = smollm2_tokenizer.encode(text)
    split = [i for i in ids if _is_partial_utf8(smollm2_tokenizer.token_bytes(i))]
    assert split, "the text should contain a character spread over several tokens"
    for skip in (True, False):
        stream = smollm2_tokenizer.decode_stream(skip_special_tokens=skip)
        deltas = [stream.step(i) for i in ids]
        assert "".join(deltas) == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
        assert all("\ufffd" not in d for d in deltas)


def _is_partial_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_token_bytes_concatenate_to_the_text(smollm2_tokenizer):
    text = "Grüße 😀 日本語, code:\tx = 1"
    ids = smollm2_tokenizer.encode(text)
    assert b"".join(smollm2_tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert smollm2_tokenizer.token_bytes(2) == b"<|im_end|>"
    assert smollm2_tokenizer.token_text(smollm2_tokenizer.encode(" world")[0]) == " world"


def test_tokenizer_json_folder_matches_gguf_tokenizer(smollm2_tokenizer, reference, tmp_path):
    reference.save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if not config.get("chat_template") and not (tmp_path / "chat_template.jinja").exists():
        config["chat_template"] = smollm2_tokenizer.chat_template
        config_path.write_text(json.dumps(config))
    folder = Tokenizer.from_pretrained_dir(tmp_path)
    for text in TEXTS.values():
        assert folder.encode(text) == smollm2_tokenizer.encode(text)
    messages = CONVERSATIONS["system"]
    expected = smollm2_tokenizer.apply_chat_template(messages)
    assert folder.apply_chat_template(messages) == expected
    assert folder.eos_token_ids[0] == 2 and folder.bos_token_id == 1


def test_template_environment_matches_transformers_helpers(smollm2_tokenizer):
    template = (
        "{{ bos_token }}{{ messages[0]['content'] | tojson }}"
        "{% if messages | length > 1 %}{{ raise_exception('only one message') }}{% endif %}"
    )
    out = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "<a> & é"}],
                                                chat_template=template)  # fmt: skip
    assert out == '<|im_start|>"<a> & é"'
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError, match="only one message"):
        smollm2_tokenizer.apply_chat_template(two, chat_template=template)
    year = smollm2_tokenizer.apply_chat_template([], chat_template="{{ strftime_now('%Y') }}")
    assert len(year) == 4 and year.isdigit()


def test_byte_tokenizer_covers_a_larger_model_vocabulary():
    tok = ByteTokenizer(vocab_size=1000)
    text = "héllo 😀"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.vocab_size == 1000
    assert tok.decode([256 + ord("a"), 512 + ord("b")]) == "ab"
    assert tok.encode("<|im_end|>") == [259] and 259 in tok.eos_token_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    stream = tok.decode_stream()
    assert "".join(stream.step(i) for i in ids) == text
