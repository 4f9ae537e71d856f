"""Offline use of the engine in the calling process: batch in, completions out."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.messages import EngineRequest, MediaItem, TokenLogprob
from engine.sampling_params import SamplingParams


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str | None = None  # the tokens decoded, for a prompt given as text


class LLM:
    """Runs an ``EngineCore`` in this process. ``generate`` submits every prompt at once
    and steps the engine until all finish, so they are batched continuously."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.core = EngineCore(config or EngineConfig())
        self.tokenizer = self.core.tokenizer
        self._ids = itertools.count()

    def generate(
        self, prompts: Sequence[list[int] | str],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        media: Sequence[Sequence[MediaItem]] | None = None,
    ) -> list[Completion]:  # fmt: skip
        """Each prompt is token ids, or text (tokenized as the model's tokenizer does, its
        completion's ``text`` decoded). ``sampling``: one for all, or one each (default:
        ``SamplingParams()``); ``media``: each prompt's images
        (``engine.vision.place_images``)."""
        sampling = SamplingParams() if sampling is None else sampling
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else sampling
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        results = {rid: Completion() for rid in ids}
        images = media or [()] * len(prompts)
        for rid, prompt, sp, items in zip(ids, prompts, params, images):
            request = EngineRequest(rid, self._token_ids(prompt), sp, media=list(items))
            error = self.core.add_request(request)
            if error is not None:
                raise ValueError(error.error)
        while self.core.has_work:
            for out in self.core.step():
                done = results[out.request_id]
                done.token_ids.extend(out.new_token_ids)
                done.logprobs.extend(out.logprobs or [])
                done.num_cached_tokens = out.num_cached_tokens
                done.finish_reason = out.finish_reason
        for prompt, rid in zip(prompts, ids):
            if isinstance(prompt, str):
                results[rid].text = self.tokenizer.decode(results[rid].token_ids)
        return [results[rid] for rid in ids]

    def _token_ids(self, prompt: list[int] | str) -> list[int]:
        if not isinstance(prompt, str):
            try:
                return [operator.index(t) for t in prompt]
            except TypeError:
                raise TypeError("a prompt is a string or a list of token ids (ints)") from None
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompts as token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)
