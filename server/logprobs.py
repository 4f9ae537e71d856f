"""Engine ``TokenLogprob``s in the shapes clients read: OpenAI chat and legacy completions
logprobs, the echoed prompt's logprobs, and vLLM's ``prompt_logprobs``.

A token's text is its own decoding; a token that is only part of a multi-byte character
(its bytes are not UTF-8 on their own) is written as OpenAI writes it, ``bytes:\\xNN...``,
so distinct tokens never share a text and no ``top_logprobs`` entry is lost.
"""

from __future__ import annotations

from typing import Any

from engine.messages import TokenLogprob
from server.protocol import (
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobList,
    TopLogprob,
)


class LogprobFormatter:
    """Formats logprobs with ``top`` alternatives per token (fewer if the engine sent fewer)."""

    def __init__(self, tokenizer: Any, top: int) -> None:
        self.tokenizer = tokenizer
        self.top = top

    def text(self, token_id: int) -> str:
        """The token as text; ``bytes:\\xNN...`` when its bytes are a partial character."""
        text = self.tokenizer.token_text(token_id)
        if "\ufffd" not in text:
            return text
        raw = self.tokenizer.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def bytes(self, token_id: int) -> list[int]:
        return list(self.tokenizer.token_bytes(token_id))

    def _top(self, entry: TokenLogprob) -> list[tuple[int, float]]:
        return list(zip(entry.top_ids[: self.top], entry.top_logprobs[: self.top]))

    # -- chat --------------------------------------------------------------------------------

    def chat(self, entry: TokenLogprob) -> ChatTokenLogprob:
        alternatives = [
            TopLogprob(token=self.text(t), logprob=lp, bytes=self.bytes(t))
            for t, lp in self._top(entry)
        ]
        return ChatTokenLogprob(
            token=self.text(entry.token_id),
            logprob=entry.logprob,
            bytes=self.bytes(entry.token_id),
            top_logprobs=alternatives,
        )

    # -- legacy completions ------------------------------------------------------------------

    def _top_dict(self, entry: TokenLogprob) -> dict[str, float]:
        """The alternatives by text, and the token itself under its own text."""
        top = {self.text(t): lp for t, lp in self._top(entry)}
        top[self.text(entry.token_id)] = entry.logprob
        return top

    def extend(
        self,
        target: CompletionLogprobs,
        token_ids: list[int],
        entries: list[TokenLogprob],
        offsets: list[int],
        base: int,
    ) -> None:
        """Append generated tokens; ``base`` is where the generated text starts."""
        for token_id, entry, offset in zip(token_ids, entries, offsets, strict=True):
            target.tokens.append(self.text(token_id))
            target.token_logprobs.append(entry.logprob)
            target.top_logprobs.append(self._top_dict(entry))
            target.text_offset.append(base + offset)

    def prompt(
        self, token_ids: list[int], entries: list[TokenLogprob | None] | None
    ) -> CompletionLogprobs:
        """The echoed prompt's tokens, offsets and (when ``entries`` are given, from the
        engine's ``prompt_logprobs``) logprobs; the first token's are null, as OpenAI's."""
        decoder = self.tokenizer.decode_stream(skip_special_tokens=True)
        result = CompletionLogprobs()
        offset = 0
        for i, token_id in enumerate(token_ids):
            entry = entries[i] if entries is not None else None
            result.tokens.append(self.text(token_id))
            result.token_logprobs.append(None if entry is None else entry.logprob)
            result.top_logprobs.append(None if entry is None else self._top_dict(entry))
            result.text_offset.append(offset)
            offset += len(decoder.step(token_id))
        return result

    # -- vLLM's prompt_logprobs --------------------------------------------------------------

    def vllm_prompt(self, entries: list[TokenLogprob | None]) -> PromptLogprobList:
        """Per prompt token: ``{token id: {logprob, rank, decoded_token}}`` for the token
        itself, then its alternatives (ranks 1, 2, ...)."""
        out: PromptLogprobList = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            position = {str(entry.token_id): self._vllm(entry.token_id, entry.logprob,
                                                        entry.rank)}  # fmt: skip
            for rank, (t, lp) in enumerate(self._top(entry), start=1):
                position.setdefault(str(t), self._vllm(t, lp, rank))
            out.append(position)
        return out

    def _vllm(self, token_id: int, logprob: float, rank: int | None) -> PromptLogprob:
        return PromptLogprob(logprob=logprob, rank=rank, decoded_token=self.text(token_id))
