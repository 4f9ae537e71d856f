"""The OpenAI API as the official ``openai`` client sees it, against a real ``ferry serve``."""

from __future__ import annotations

import asyncio

import openai
import pytest

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=server.api_key, timeout=120, max_retries=0)


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.v1, api_key=server.api_key, timeout=120, max_retries=0
    )


def _chat(client: openai.OpenAI, **kwargs):
    kwargs.setdefault("model", client.models.list().data[0].id)
    kwargs.setdefault("messages", QUESTION)
    return client.chat.completions.create(**kwargs)


def test_chat_answers_the_capital_of_france(client, server):
    reply = _chat(client, temperature=0, max_tokens=16)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert reply.model == server.model
    usage = reply.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens <= 16
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_with_usage_concatenates_to_the_non_stream_text(client):
    reference = _chat(client, temperature=0, max_tokens=12).choices[0].message.content
    chunks = list(
        _chat(client, temperature=0, max_tokens=12, stream=True,
              stream_options={"include_usage": True})
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == reference
    finishes = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert usage_chunk.usage.total_tokens == (
        usage_chunk.usage.prompt_tokens + usage_chunk.usage.completion_tokens
    )


def test_chat_accepts_text_content_parts(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}]
    reply = _chat(client, messages=parts, temperature=0, max_tokens=16)
    assert "Paris" in reply.choices[0].message.content


def test_completions_string_prompt(client, server):
    reply = client.completions.create(model=server.model, prompt="The capital of France is",
                                      max_tokens=8, temperature=0)  # fmt: skip
    assert reply.object == "text_completion"
    assert reply.id.startswith("cmpl-")
    assert len(reply.choices) == 1 and reply.choices[0].text
    assert reply.usage.completion_tokens <= 8


def test_completions_token_id_prompt_matches_string_prompt(client, server, smollm2_tokenizer):
    prompt = "The capital of France is"
    by_text = client.completions.create(model=server.model, prompt=prompt, max_tokens=6,
                                        temperature=0)  # fmt: skip
    ids = smollm2_tokenizer.encode(prompt, add_special_tokens=True)
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=6,
                                       temperature=0)  # fmt: skip
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_completions_list_of_prompts_orders_choices_by_prompt(client, server, smollm2_tokenizer):
    prompts = ["One, two, three,", "The capital of France is"]
    reply = client.completions.create(model=server.model, prompt=prompts, max_tokens=4,
                                      temperature=0, n=2)  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.choices[0].text == reply.choices[1].text  # greedy: siblings agree
    assert reply.choices[2].text == reply.choices[3].text
    expected = sum(len(smollm2_tokenizer.encode(p, add_special_tokens=True)) for p in prompts)
    assert reply.usage.prompt_tokens == expected


def test_completions_echo_prepends_the_prompt(client, server):
    prompt = "The capital of France is"
    reply = client.completions.create(model=server.model, prompt=prompt, max_tokens=4,
                                      temperature=0, echo=True)  # fmt: skip
    choice = reply.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    assert choice.logprobs is None


def test_models_list_names_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert client.models.retrieve(server.model).id == server.model


def test_n2_returns_two_choices_reproducible_with_a_seed(client):
    def run():
        reply = _chat(client, n=2, temperature=1.0, seed=1234, max_tokens=8)
        assert [c.index for c in reply.choices] == [0, 1]
        return [c.message.content for c in reply.choices]

    first = run()
    assert first == run()


def test_seed_makes_temperature_1_reproducible(client):
    texts = {_chat(client, temperature=1.0, seed=7, max_tokens=12).choices[0].message.content
             for _ in range(2)}  # fmt: skip
    assert len(texts) == 1


def test_logprobs_with_top_logprobs_3(client):
    reply = _chat(client, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert all(alt.logprob <= 0 for alt in entry.top_logprobs)
        assert entry.logprob >= min(alt.logprob for alt in entry.top_logprobs) - 1e-4
    text = "".join(bytes(e.bytes).decode("utf-8", errors="replace") for e in content)
    assert reply.choices[0].message.content in text  # EOS adds nothing visible


def test_stop_string_cuts_the_text_before_it(client):
    reply = _chat(client, temperature=0, max_tokens=16, stop=["Paris"])
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert "Paris" not in choice.message.content
    assert choice.message.content.rstrip().endswith("is")


def test_stop_string_while_streaming_never_sends_part_of_it(client):
    chunks = list(_chat(client, temperature=0, max_tokens=16, stop=[" France is Par"],
                        stream=True))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_ends_with_finish_reason_length(client):
    reply = _chat(client, temperature=0, max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3
    reply = _chat(client, temperature=0, max_completion_tokens=2)
    assert reply.usage.completion_tokens == 2


async def test_16_concurrent_streams_all_complete(async_client, server):
    async def one(i: int) -> tuple[str, str | None]:
        stream = await async_client.chat.completions.create(
            model=server.model, messages=QUESTION, temperature=0.8, seed=i, max_tokens=8,
            stream=True,
        )  # fmt: skip
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    results = await asyncio.gather(*(one(i) for i in range(16)))
    assert all(finish in ("stop", "length") for _, finish in results)
    assert all(text for text, _ in results)
