"""A request's output queue as the frontend reads it (``engine.client.outputs_of``):
outputs that piled up while the reader was busy come out as one, in order, and nothing
is lost or reordered around an ending or an error."""

from __future__ import annotations

import asyncio

import pytest

from engine.client import EngineDeadError, offer, outputs_of
from engine.messages import RequestOutput, TokenLogprob


def _out(tokens: list[int], finish: str | None = None, **kw) -> RequestOutput:
    return RequestOutput("r", tokens, finish, **kw)


async def _read(queue: asyncio.Queue) -> list[RequestOutput]:
    return [out async for out in outputs_of(queue)]


def test_outputs_that_piled_up_come_out_joined_in_order():
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(5):
            offer(queue, _out([i], num_cached_tokens=16 if i == 0 else 0))
        offer(queue, _out([5], "length", stop_token_id=None))
        (out,) = await _read(queue)
        assert out.new_token_ids == [0, 1, 2, 3, 4, 5]
        assert out.finish_reason == "length" and out.num_cached_tokens == 16

    asyncio.run(main())


def test_a_reader_that_keeps_up_gets_every_output_on_its_own():
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        got: list[list[int]] = []

        async def produce():
            for i in range(3):
                offer(queue, _out([i], "stop" if i == 2 else None))
                await asyncio.sleep(0.01)

        task = asyncio.create_task(produce())
        async for out in outputs_of(queue):
            got.append(out.new_token_ids)
        await task
        assert got == [[0], [1], [2]]

    asyncio.run(main())


def test_joined_outputs_keep_their_logprobs_and_the_first_prompt_logprobs():
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        a, b = TokenLogprob(7, -0.5, [], []), TokenLogprob(8, -0.25, [], [])
        offer(queue, _out([7], logprobs=[a], prompt_logprobs=[None, a]))
        offer(queue, _out([8], "stop", logprobs=[b]))
        (out,) = await _read(queue)
        assert out.logprobs == [a, b] and out.prompt_logprobs == [None, a]

    asyncio.run(main())


def test_nothing_after_the_last_output_is_read():
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        offer(queue, _out([1], "stop"))
        offer(queue, _out([2]))  # a straggler after the end (never joined to it)
        (out,) = await _read(queue)
        assert out.new_token_ids == [1] and queue.qsize() == 1

    asyncio.run(main())


def test_an_error_behind_outputs_comes_after_them():
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        offer(queue, _out([1]))
        offer(queue, _out([2]))
        offer(queue, EngineDeadError("gone"))
        got = []
        with pytest.raises(EngineDeadError):
            async for out in outputs_of(queue):
                got.append(out.new_token_ids)
        assert got == [[1, 2]]

    asyncio.run(main())
