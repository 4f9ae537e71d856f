"""Prefill and decode workers in one process (no ZMQ): the hand-off, the decode worker's
reservation timeout, and aborts that arrive while KV is on its way."""

from __future__ import annotations

import threading
import time

import pytest

import decode.worker as decode_worker
from decode.messages import DecodeRequest, KVFailed, KVReady, KVWanted
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core import EngineCore
from engine.messages import Abort, EngineRequest
from engine.sampling_params import SamplingParams
from engine.worker.config import TransferConfig, WorkerConfig
from engine.worker.shell import Outbox
from kvstore.hashing import hash_chain
from prefill.messages import PrefillDone, PrefillFailed, PrefillRequest
from prefill.worker import PrefillWorker

CONFIG = EngineConfig(model="dummy:tiny", num_threads=1,
                      cache=CacheConfig(num_blocks=128, block_size=4))  # fmt: skip
SECRET = "test-cluster-secret"  # what the two roles' KV transport proves to itself
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [1 + i % 200 for i in range(30)]


def decode_role(config: EngineConfig, transport: str, timeout: float = 30):
    transfer = TransferConfig(transport, timeout_s=timeout, local_prefill_tokens=0)
    return decode_worker.DecodeWorker(WorkerConfig("decode", config, transfer), SECRET)


def prefill_role(config: EngineConfig, transport: str, timeout: float = 30) -> PrefillWorker:
    return PrefillWorker(WorkerConfig("prefill", config, TransferConfig(transport, timeout)),
                         SECRET)  # fmt: skip


@pytest.fixture
def decode():
    worker = decode_role(CONFIG, "tcp")
    yield worker
    worker.close()


@pytest.fixture
def prefill():
    worker = prefill_role(CONFIG, "tcp")
    yield worker
    worker.close()


def replies(outbox: Outbox) -> list:
    return [msg for msg, _ in outbox.replies]


def wanted(d) -> KVWanted:
    return next(m for m in replies(d.step()) if isinstance(m, KVWanted))


def prefill_request(want: KVWanted, sampling=GREEDY, prompt=PROMPT) -> PrefillRequest:
    return PrefillRequest(EngineRequest(want.request_id, prompt, sampling), want.destination)


def run_prefill(p: PrefillWorker, want: KVWanted) -> PrefillDone | PrefillFailed:
    return run_prefill_with(p, want, GREEDY)


def run_prefill_with(p: PrefillWorker, want: KVWanted, sampling) -> PrefillDone | PrefillFailed:
    p.handle(prefill_request(want, sampling))
    return prefill_outcome(p)


def prefill_outcome(p: PrefillWorker, timeout: float = 30) -> PrefillDone | PrefillFailed:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [m for m in replies(p.step()) if isinstance(m, PrefillDone | PrefillFailed)]
        if done:
            return done[0]
        time.sleep(0.001)
    raise TimeoutError


def first_token(done: PrefillDone) -> list[int]:
    return list(done.output.new_token_ids)


def clean(worker) -> None:
    worker.core.check_integrity()
    assert worker.core.kv.pool.num_free == worker.core.kv.pool.num_usable
    assert worker.sched.num_transferring == 0


def test_hand_off_matches_a_local_run(decode, prefill):
    local = EngineCore(CONFIG)
    local.add_request(EngineRequest("ref", PROMPT, GREEDY))
    expected = []
    while local.has_work:
        expected += [t for o in local.step() for t in o.new_token_ids]

    decode.handle(DecodeRequest(EngineRequest("r", PROMPT, GREEDY)))
    want = wanted(decode)
    assert want.destination.skip_blocks == 0 and len(want.destination.block_ids) == 8
    done = run_prefill(prefill, want)
    assert isinstance(done, PrefillDone) and done.num_blocks == 8
    clean(prefill)  # released; its full blocks stay cached
    decode.handle(KVReady(done.output))
    got = first_token(done)  # the client has it from the prefill worker
    while True:
        outs = decode.step().outputs
        got += [t for o in outs for t in o.new_token_ids]
        if any(o.finish_reason for o in outs):
            break
    assert got == expected
    clean(decode)


def test_reservation_expires_without_kv(decode, monkeypatch):
    monkeypatch.setattr(decode_worker, "GRACE_S", 0.0)
    decode.timeout = 0.05
    decode.handle(DecodeRequest(EngineRequest("r", PROMPT, GREEDY)))
    wanted(decode)
    assert decode.sched.num_transferring == 1
    time.sleep(0.1)
    outs = decode.step().outputs
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r", "error")]
    assert "did not arrive" in outs[0].error
    clean(decode)


def test_abort_while_kv_is_coming_waits_for_the_outcome(decode):
    decode.handle(DecodeRequest(EngineRequest("r", PROMPT, GREEDY)))
    wanted(decode)
    decode.handle(Abort(["r"]))
    decode.step()
    assert decode.sched.num_transferring == 1  # blocks kept: a write may still land
    decode.handle(KVFailed("r", "aborted"))
    outs = decode.step().outputs
    assert outs == []  # the client is gone: no error for it
    clean(decode)


def test_prefill_abort_before_and_after_the_prompt(decode, prefill):
    decode.handle(DecodeRequest(EngineRequest("r", PROMPT, GREEDY)))
    want = wanted(decode)
    prefill.handle(prefill_request(want))
    prefill.handle(Abort(["r"]))
    msgs = replies(prefill.tick())
    assert any(isinstance(m, PrefillFailed) and m.aborted for m in msgs)
    clean(prefill)
    prefill.handle(Abort(["unknown"]))  # nothing to do, nothing sent
    assert not [m for m in replies(prefill.tick()) if isinstance(m, PrefillFailed)]


def test_structured_hand_off_constrains_the_first_token_and_resumes_the_matcher():
    """The prefill worker samples the first token under the grammar; the decode worker
    replays it into its own matcher and keeps the rest of the output in the language."""
    import re

    from engine.sampling_params import GrammarSpec

    config = EngineConfig(model="default", num_threads=1,
                          cache=CacheConfig(num_blocks=32, block_size=16))  # fmt: skip
    pattern = r"(yes|no), [a-z]{1,8}( [a-z]{1,8}){0,3}\."
    sampling = SamplingParams(temperature=1.0, seed=11, max_tokens=40,
                              grammar=GrammarSpec("regex", pattern))  # fmt: skip
    d = decode_role(config, "tcp", 60)
    p = prefill_role(config, "tcp", 60)
    try:
        prompt = d.core.tokenizer.encode("Is the sky blue? Answer in a few words." * 2)
        d.handle(DecodeRequest(EngineRequest("s", prompt, sampling)))
        deadline = time.monotonic() + 60
        want = None
        while want is None and time.monotonic() < deadline:  # the grammar compiles first
            want = next((m for m in replies(d.step()) if isinstance(m, KVWanted)), None)
        p.handle(prefill_request(want, sampling, prompt))
        done = prefill_outcome(p, 60)
        assert isinstance(done, PrefillDone)
        d.handle(KVReady(done.output))
        tokens, reason = first_token(done), None
        while reason is None and time.monotonic() < deadline:
            outs = d.step().outputs
            tokens += [t for o in outs for t in o.new_token_ids]
            reason = next((o.finish_reason for o in outs if o.finish_reason), None)
        assert reason == "stop"
        text = d.core.tokenizer.decode(tokens)
        assert re.fullmatch(pattern, text), text
        clean(d)
    finally:
        d.close()
        p.close()


STREAM_CONFIG = EngineConfig(model="dummy:tiny", num_threads=1,
                             cache=CacheConfig(num_blocks=128, block_size=4),
                             scheduler=SchedulerConfig(max_num_batched_tokens=8))  # fmt: skip


def reference_tokens(config: EngineConfig, prompt: list[int]) -> list[int]:
    local = EngineCore(config)
    local.add_request(EngineRequest("ref", prompt, GREEDY))
    tokens = []
    while local.has_work:
        tokens += [t for o in local.step() for t in o.new_token_ids]
    return tokens


def decode_to_end(d, first: list[int]) -> list[int]:
    got = list(first)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        outs = d.step().outputs
        got += [t for o in outs for t in o.new_token_ids]
        if any(o.finish_reason for o in outs):
            return got
    raise TimeoutError


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_kv_streams_to_the_decode_worker_while_the_prompt_is_prefilled(transport):
    """With chunked prefill (8 tokens a step) most blocks leave before the prompt is done;
    the decode worker's output is still that of a local run."""
    d = decode_role(STREAM_CONFIG, transport)
    p = prefill_role(STREAM_CONFIG, transport)
    try:
        d.handle(DecodeRequest(EngineRequest("r", PROMPT, GREEDY)))
        done = run_prefill(p, wanted(d))
        assert isinstance(done, PrefillDone) and done.num_blocks == 8
        assert done.num_streamed_blocks >= 6  # all but the last chunk's blocks
        clean(p)
        d.handle(KVReady(done.output))
        assert decode_to_end(d, first_token(done)) == reference_tokens(STREAM_CONFIG, PROMPT)
        clean(d)
    finally:
        d.close()
        p.close()


def test_blocks_being_sent_stay_pinned_when_the_prefill_is_aborted_mid_send():
    """An abort while a chunk's send is in flight frees the request but not the blocks the
    send reads: nothing else may be written into them until the send has ended, and the
    abort is reported only then (the decode worker frees its reservation on it)."""
    d = decode_role(STREAM_CONFIG, "tcp")
    p = prefill_role(STREAM_CONFIG, "tcp")
    gate = threading.Event()
    real_send = p.sender.send

    def held_send(*args, **kwargs):
        gate.wait(30)
        return real_send(*args, **kwargs)

    p.sender.send = held_send
    try:
        d.handle(DecodeRequest(EngineRequest("r", PROMPT, GREEDY)))
        p.handle(prefill_request(wanted(d)))
        while not p.sending:
            p.step()
        pinned = [b for _, blocks in p.shipments["r"].jobs for b in blocks]
        p.handle(Abort(["r"]))
        assert not [m for m in replies(p.tick()) if isinstance(m, PrefillFailed)]
        assert all(b.ref_count == 1 for b in pinned)  # only the send holds them
        p.core.check_integrity()
        free_before = p.core.kv.pool.num_free
        assert free_before == p.core.kv.pool.num_usable - len(pinned)
        gate.set()
        deadline = time.monotonic() + 30
        failed = []
        while not failed and time.monotonic() < deadline:
            failed = [m for m in replies(p.step()) if isinstance(m, PrefillFailed)]
            time.sleep(0.001)
        assert failed[0].aborted
        clean(p)
        d.handle(KVFailed("r", "aborted"))
        d.step()
        clean(d)
    finally:
        gate.set()
        d.close()
        p.close()


def test_a_request_ended_by_its_first_token_leaves_no_unsent_kv_in_the_cache(decode, prefill):
    """max_tokens=1: the prefill worker sends no KV, so the decode worker must not publish
    the blocks it reserved (a later prompt would read garbage from them)."""
    one = SamplingParams(temperature=0, max_tokens=1)
    decode.handle(DecodeRequest(EngineRequest("r", PROMPT, one)))
    want = wanted(decode)
    done = run_prefill_with(prefill, want, one)
    decode.handle(KVReady(done.output))
    outs = decode.step().outputs
    assert [o.finish_reason for o in outs] == ["length"]
    assert decode.core.kv.pool.lookup(hash_chain(PROMPT, 4, decode.core.hash_extra)) == []
    clean(decode)


def test_time_waiting_for_a_prefill_worker_does_not_count_against_the_transfer_timeout():
    """The transfer timeout runs from when the prefill starts: a prompt that waited longer
    than it in the prefill queue is still computed and sent."""
    d = decode_role(CONFIG, "tcp", timeout=1.0)
    p = prefill_role(CONFIG, "tcp", timeout=1.0)
    try:
        d.handle(DecodeRequest(EngineRequest("r", PROMPT, GREEDY)))
        want = wanted(d)
        time.sleep(1.5)  # behind other prompts in the prefill worker's queue, say
        done = run_prefill(p, want)
        assert isinstance(done, PrefillDone), done
        d.handle(KVReady(done.output))
        assert decode_to_end(d, first_token(done)) == reference_tokens(CONFIG, PROMPT)
        clean(d)
    finally:
        d.close()
        p.close()
