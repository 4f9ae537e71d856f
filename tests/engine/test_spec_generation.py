"""Speculative decoding through the whole engine, on tiny checkpoints written by
transformers (``hf_models``): greedy outputs are the same tokens as without speculation for
every drafter, one request at a time and batched, with chunked prefill and 4-token blocks
(so verify chunks and rejected drafts cross block boundaries); structured output keeps its
grammar; logprobs stay the target's.

Drafters: prompt lookup (n-gram); a draft model, both the target itself (every draft
kept: the accepted path, the draft model's KV lookahead) and another random model (most
drafts rejected: the rollback path); DeepSeek-V3's MTP layer, of a random checkpoint (every
draft rejected) and of a successor machine (``hf_models.make_successor``: most drafts
kept, the MTP's accept path, with and without overlap scheduling).
"""

from __future__ import annotations

import pytest
from hf_models import SUCCESSOR, write_tiny_model

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.llm import LLM
from engine.sampling_params import GrammarSpec, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def prompts() -> list[list[int]]:
    """Repetitive prompts (prompt lookup finds matches) and plain ones, 5 to 40 tokens."""
    return [
        [40, 41, 42, 43, 44] * 4,
        [7, 8, 9, 10, 11, 12, 13, 7, 8, 9, 10, 11, 12, 13, 7, 8],
        [100 + (i * 37) % 150 for i in range(40)],
        [65, 66, 67, 68, 69],
        [200, 3, 200, 3, 200, 3, 200, 3, 200],
        [1 + (i * 11) % 250 for i in range(23)],
    ]


NO_SPECULATION = SpeculativeConfig()


def engine(model: str, speculative: SpeculativeConfig = NO_SPECULATION, **kw) -> LLM:
    return LLM(EngineConfig(
        model=model, num_threads=1, cache=CacheConfig(block_size=4, num_blocks=400),
        scheduler=SchedulerConfig(max_num_batched_tokens=32), speculative=speculative, **kw,
    ))  # fmt: skip


@pytest.fixture(scope="module")
def llama(tiny_moe_dir) -> str:
    return str(tiny_moe_dir("llama"))


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory) -> str:
    """Another random Llama with the same vocabulary: a poor draft model."""
    return str(write_tiny_model("llama", tmp_path_factory.mktemp("draft-llama"), seed=1))


@pytest.fixture(scope="module")
def deepseek_mtp(tiny_moe_dir) -> str:
    return str(tiny_moe_dir("deepseek-v3-mtp"))


@pytest.fixture(scope="module")
def deepseek_successor(tiny_moe_dir) -> str:
    """DeepSeek-V3 whose MTP layer's drafts are mostly kept (``hf_models.make_successor``)."""
    return str(tiny_moe_dir(SUCCESSOR))


_REFERENCE: dict[str, list[list[int]]] = {}


def reference(model: str) -> list[list[int]]:
    """Greedy outputs without speculation, one prompt at a time."""
    if model not in _REFERENCE:
        llm = engine(model)
        _REFERENCE[model] = [llm.generate([p], GREEDY)[0].token_ids for p in prompts()]
    return _REFERENCE[model]


def drafter_case(name: str, llama: str, other: str, deepseek: str) -> tuple[str, dict]:
    """(target model, the SpeculativeConfig fields) of drafter ``name``."""
    return {
        "ngram": (llama, dict(method="ngram")),
        "draft-self": (llama, dict(method="draft", draft_model=llama)),
        "draft-other": (llama, dict(method="draft", draft_model=other)),
        "mtp": (deepseek, dict(method="mtp", confidence_temperatures=(1.0, 0.9, 0.8))),
    }[name]


def on_device_case(name: str, llama: str, successor: str) -> tuple[str, dict]:
    """(target model, the SpeculativeConfig fields) of a drafter that drafts on the device,
    keeping drafts where it can: prompt lookup, the target drafting for itself, and the
    successor machine's MTP layer."""
    return {
        "ngram": (llama, dict(method="ngram")),
        "draft-self": (llama, dict(method="draft", draft_model=llama)),
        "mtp-kept": (successor, dict(method="mtp", confidence_temperatures=(0.3,) * 3)),
    }[name]


def assert_reference_alone_and_batched(llm: LLM, model: str) -> None:
    """``llm`` gives the greedy outputs without speculation, one prompt at a time and all
    at once (no prefix cache hits between the two), and leaves every block free and the
    allocator whole."""
    expected = reference(model)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts()]
    assert alone == expected
    llm.core.kv.pool.reset_prefix_cache()
    batched = [r.token_ids for r in llm.generate(prompts(), GREEDY)]
    assert batched == expected
    llm.core.check_integrity()
    assert llm.core.kv.pool.num_free == llm.core.kv.pool.num_usable


@pytest.mark.parametrize("schedule", ["fixed", "dynamic"])
@pytest.mark.parametrize("name", ["ngram", "draft-self", "draft-other", "mtp"])
def test_greedy_outputs_equal_without_speculation(name, schedule, llama, other_llama,
                                                  deepseek_mtp):  # fmt: skip
    model, fields = drafter_case(name, llama, other_llama, deepseek_mtp)
    spec = SpeculativeConfig(num_speculative_tokens=3, schedule=schedule, **fields)
    llm = engine(model, spec)
    assert_reference_alone_and_batched(llm, model)
    stats = llm.core.scheduler.stats()
    assert sum(stats.spec_draft_verified) > 0  # drafts really were verified
    if name in ("ngram", "draft-self"):
        assert sum(stats.spec_draft_accepted) > 0
    if name == "draft-self":  # a model drafting for itself: every greedy draft is kept
        assert stats.spec_draft_accepted == stats.spec_draft_verified


def test_logprobs_stay_the_targets(llama):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    plain = engine(llama).generate(prompts()[:2], params)
    spec = engine(llama, SpeculativeConfig(method="draft", draft_model=llama,
                                           num_speculative_tokens=3))  # fmt: skip
    got = spec.generate(prompts()[:2], params)
    assert sum(spec.core.scheduler.stats().spec_draft_accepted) > 0
    for a, b in zip(plain, got):
        assert a.token_ids == b.token_ids
        assert [x.top_ids for x in a.logprobs] == [x.top_ids for x in b.logprobs]
        for x, y in zip(a.logprobs, b.logprobs):
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
            assert y.top_logprobs == pytest.approx(x.top_logprobs, abs=1e-4)


def test_a_request_can_opt_out(llama):
    spec = engine(llama, SpeculativeConfig(method="draft", draft_model=llama,
                                           num_speculative_tokens=3))  # fmt: skip
    out = spec.generate(prompts()[:1], SamplingParams(temperature=0.0, max_tokens=12,
                                                      ignore_eos=True, speculative=False))
    assert out[0].token_ids == reference(llama)[0][:12]
    assert sum(spec.core.scheduler.stats().spec_draft_verified) == 0


STRUCTURED = [
    GrammarSpec("regex", "(ab|cd|ef){3,12}"),
    GrammarSpec("json", '{"type":"object","properties":{"a":{"type":"string","maxLength":6},'
                        '"b":{"type":"integer"}},"required":["a","b"]}'),
]  # fmt: skip


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("name", ["ngram", "draft-self", "mtp"])
@pytest.mark.parametrize("grammar", STRUCTURED, ids=["regex", "json"])
def test_structured_output_is_the_same_with_drafts_through_the_matcher(
    grammar, name, overlap, llama, other_llama, deepseek_mtp
):
    """Greedy under a grammar: the same tokens with prompt lookup (drafts from the prompt
    the grammar lets through are verified), with a draft model and with DeepSeek-V3's MTP
    layer (whose unconstrained drafts the grammar cuts at the first it rejects). Under
    overlap the step after a verify step is planned before its outcome and sampled once
    it is collected, its drafts made on the device masked as the host then has them."""
    from tests.engine.drafting import generate_recorded

    model, fields = drafter_case(name, llama, other_llama, deepseek_mtp)
    params = SamplingParams(temperature=0.0, max_tokens=40, grammar=grammar)
    ask = [[ord(c) for c in "abcdabcd ef ef ab {\"a\": \"ab\", \"b\": 12}"]] * 2
    ask.append([ord(c) for c in "cdcdcdcd"])
    expected = [r.token_ids for r in engine(model).generate(ask, params)]
    spec = SpeculativeConfig(num_speculative_tokens=3, schedule="fixed", **fields)
    llm = engine(model, spec, overlap_scheduling=overlap)
    run = generate_recorded(llm, ask, params)
    assert run.outputs == expected
    stats = llm.core.scheduler.stats()
    # a random model's first draft never fits the regex: cut there, nothing is verified
    if name == "ngram" or grammar.kind == "json":
        assert sum(stats.spec_draft_verified) > 0
        assert (run.early > 0) == overlap
    if name == "ngram":
        assert sum(stats.spec_draft_accepted) > 0


@pytest.mark.parametrize("schedule", ["fixed", "dynamic"])
@pytest.mark.parametrize("name", ["ngram", "draft-self", "mtp"])
def test_overlap_scheduling_with_drafts_gives_the_same_tokens(
    name, schedule, llama, other_llama, deepseek_mtp
):
    """Under overlap a step is planned before the last one's tokens are back: drafts one
    step old are verified after the unresolved token (their first guessing it), and a step
    that verifies drafts is collected before the next is planned. Fixed verifies drafts
    every step, so some are kept; dynamic decides from measured times and may verify few
    on a busy machine (lagged statistics), but what it keeps must be right."""
    model, fields = drafter_case(name, llama, other_llama, deepseek_mtp)
    spec = SpeculativeConfig(num_speculative_tokens=3, schedule=schedule, **fields)
    llm = engine(model, spec, overlap_scheduling=True)
    assert llm.core.scheduler.spec.lagged
    batched = [r.token_ids for r in llm.generate(prompts(), GREEDY)]
    assert batched == reference(model)
    assert llm.core.scheduler.spec.host.ready  # the host work the policy counts, measured
    stats = llm.core.scheduler.stats()
    assert sum(stats.spec_draft_verified) > 0
    # the random MTP layer's drafts are all rejected (the successor machine's are kept:
    # test_mtp_drafts_mostly_kept_leave_greedy_outputs_unchanged); the random target
    # hardly repeats itself, so prompt lookup's are kept by luck alone (a model quoting
    # text: test_ngram_drafts)
    if schedule == "fixed" and name not in ("mtp", "ngram"):
        assert sum(stats.spec_draft_accepted) > 0
    llm.core.check_integrity()
    assert llm.core.kv.pool.num_free == llm.core.kv.pool.num_usable


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("schedule", ["fixed", "dynamic"])
def test_mtp_drafts_mostly_kept_leave_greedy_outputs_unchanged(
    schedule, overlap, deepseek_successor
):
    """The MTP drafter's accept path: with most verified drafts kept (their KV stays; the
    next proposal starts from the target's hidden states of the kept rows), greedy outputs
    are those without speculation, one request at a time and batched, with and without
    overlap scheduling (where drafts one step old are verified after the unresolved
    token). The layer is right far more often than its probabilities say: a calibration
    temperature below 1 lets the dynamic policy find drafts worth it."""
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=3, schedule=schedule,
                             confidence_temperatures=(0.3,) * 3)  # fmt: skip
    llm = engine(deepseek_successor, spec, overlap_scheduling=overlap)
    assert_reference_alone_and_batched(llm, deepseek_successor)
    stats = llm.core.scheduler.stats()
    verified, accepted = sum(stats.spec_draft_verified), sum(stats.spec_draft_accepted)
    # fixed verifies every draft: about 7 in 8 are kept (half where the state after kept
    # drafts is lost); dynamic picks which from timings, and those it picks are kept too
    assert verified > 0 and accepted > (0.75 if schedule == "fixed" else 0.5) * verified


def _eight_requests_speculating(method: str) -> int:
    """Eight greedy requests of 120 tokens with the drafter ``method`` (K = 3, dynamic,
    overlap on), run to the end; the steps it took (the allocators checked after)."""
    from engine.messages import EngineRequest

    llm = LLM(EngineConfig(
        model="dummy:tiny", num_threads=1, overlap_scheduling=True,
        speculative=SpeculativeConfig(method=method, num_speculative_tokens=3),
        cache=CacheConfig(block_size=16, num_blocks=200),
        scheduler=SchedulerConfig(max_num_batched_tokens=256),
    ))  # fmt: skip
    core = llm.core
    for i in range(8):
        params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        core.add_request(EngineRequest(f"r{i}", [5 + i] * 8, params))
    steps = 0
    while core.has_work:
        core.step()
        steps += 1
    core.check_integrity()
    return steps


def test_the_drafter_rests_while_the_dynamic_policy_verifies_nothing():
    """Drafts of confidence 0 never pay: once its cost model has its samples the dynamic
    policy verifies none, and the drafter is asked to propose after a few steps in
    QUIET_STEPS only (proposals for every request every step cost a busy host its time)."""
    from engine.spec import Drafter, Proposal, register_drafter

    class Zero(Drafter):
        sees_every_step = False
        asked = 0

        def propose(self, step):
            Zero.asked += bool(step.requests)
            return {r.request_id: Proposal(len(r.token_ids), [1] * r.num_draft,
                                           [0.0] * r.num_draft) for r in step.requests}  # fmt: skip

    register_drafter("zero", lambda config, target, device, dtype: Zero(config.max_draft))
    steps = _eight_requests_speculating("zero")
    assert steps > 100
    assert Zero.asked < steps / 4


def test_a_drafter_on_the_device_is_not_launched_behind_the_steps_it_rests():
    """As a drafter on the host is not asked, one on the device is not launched behind a
    step after which it rests (nothing to draft, no KV of its own to keep): such a step
    costs what a step without speculation costs (on the CPU's tiny model at 256 streams
    the launch of nobody's drafts took 0.3 ms a step)."""
    import torch

    from engine.spec import Drafter, register_drafter
    from engine.spec.base import Drafting
    from engine.spec.chain import Chained

    class ZeroOnDevice(Drafter):
        sees_every_step = False
        on_device = True
        launched = 0

        def launch(self, step):
            ZeroOnDevice.launched += 1
            ids = [r.request_id for r in step.requests]
            width = max((r.num_draft for r in step.requests), default=0)
            rows = [[d for d, r in enumerate(step.requests) if r.num_draft > depth]
                    for depth in range(width)]  # fmt: skip
            n = sum(map(len, rows))
            device = step.next_ids.device
            chained = Chained.of_flat(len(ids), rows, torch.ones(n, dtype=torch.long,
                                                                 device=device),
                                      torch.zeros(n, device=device))  # fmt: skip
            return Drafting(ids, chained)

    register_drafter("zero-on-device", lambda config, *_: ZeroOnDevice(config.max_draft))
    steps = _eight_requests_speculating("zero-on-device")
    assert steps > 100
    assert ZeroOnDevice.launched < steps / 4


def test_the_host_time_the_policy_counts_on_the_cpu_leaves_the_forward_out():
    """On the CPU ``launch`` runs the forward itself: the host work a step adds (planning,
    folding its tokens back) is what is left of it, not the forward counted twice (which
    made drafts look cheaper than they are beside a step twice as long)."""
    import time

    llm = engine("dummy:tiny", SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    runner = llm.core.runner
    logits = runner._logits

    def slow(plan):
        time.sleep(0.05)  # a forward of 50 ms, far past the host work of a tiny step
        return logits(plan)

    runner._logits = slow
    llm.generate(prompts()[:2], GREEDY)
    host = llm.core.scheduler.spec.host
    assert host.ready and host.value() < 0.025


@pytest.mark.parametrize(
    "overlap,padded", [(False, False), (True, False), (True, True)],
    ids=["serial", "overlap", "overlap-padded"],
)  # fmt: skip
def test_a_draft_model_that_is_the_target_has_every_greedy_draft_kept(overlap, padded, llama):
    """The draft model drafts on the device from the step's own tokens and positions (and,
    under overlap, from a step planned before the one before it was known): when it is the
    target itself its KV is the target's, so greedy drafts are all kept. ``padded``: its
    one-token rows go through its graphs' padded buffers (run eagerly:
    ``engine.spec.graphs``)."""
    spec = SpeculativeConfig(method="draft", draft_model=llama, num_speculative_tokens=3,
                             schedule="fixed")  # fmt: skip
    llm = engine(llama, spec, overlap_scheduling=overlap)
    if padded:
        llm.core.runner.drafter.capture_graphs(8, 256, capture=False)  # 1, 2, 4, 8 rows
    assert [r.token_ids for r in llm.generate(prompts(), GREEDY)] == reference(llama)
    stats = llm.core.scheduler.stats()
    assert sum(stats.spec_draft_verified) > 50
    assert sum(stats.spec_draft_accepted) == sum(stats.spec_draft_verified)


@pytest.mark.parametrize("name", ["ngram", "draft-self", "mtp-kept"])
def test_prompts_arriving_while_drafts_are_verified_join_the_step_planned_ahead(
    name, llama, deepseek_successor
):
    """Under overlap a prompt that arrives while a step verifies drafts goes into the next
    step, planned before that step's outcome: the device moves the verified requests'
    rows back by the drafts rejected beside the new prompt's chunks (one-token rows whose
    lengths only the device knows). Each prompt arrives while a verify step runs; the
    outputs are those without speculation and every block comes back."""
    from engine.messages import EngineRequest

    model, fields = on_device_case(name, llama, deepseek_successor)
    spec = SpeculativeConfig(num_speculative_tokens=3, schedule="fixed", **fields)
    llm = engine(model, spec, overlap_scheduling=True)
    core = llm.core
    scheduler = core.scheduler
    schedule, update = scheduler.schedule, scheduler.update
    unknown = set()  # verify steps whose outcome is not folded back yet
    joined = [0]  # steps planned before such an outcome that prefilled a prompt

    def planned():
        plan = schedule()
        joined[0] += bool(unknown) and any(not c.is_decode for c in plan.chunks)
        if plan.num_draft_tokens:
            unknown.add(id(plan))
        return plan

    def folded(plan, result):
        unknown.discard(id(plan))
        return update(plan, result)

    scheduler.schedule, scheduler.update = planned, folded
    waiting = list(enumerate(prompts()))
    tokens: dict[str, list[int]] = {}
    while waiting or core.has_work:
        inflight = core._inflight
        if waiting and (not core.has_work or inflight[0].num_draft_tokens):
            i, prompt = waiting.pop(0)
            core.add_request(EngineRequest(f"p{i}", prompt, GREEDY))
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    joined = joined[0]
    assert [tokens[f"p{i}"] for i in range(len(prompts()))] == reference(model)
    assert joined >= 3
    stats = core.scheduler.stats()
    if name != "ngram":  # (the random target hardly repeats itself)
        assert sum(stats.spec_draft_accepted) > 0.5 * sum(stats.spec_draft_verified) > 0
    core.check_integrity()
    assert core.kv.pool.num_free == core.kv.pool.num_usable


@pytest.mark.parametrize("name", ["ngram", "draft-self", "mtp-kept"])
def test_penalties_and_min_tokens_with_drafts_planned_ahead_match_no_speculation(
    name, llama, deepseek_successor
):
    """Penalties and min_tokens count a verify row's drafts and, in a step planned before
    the one before it was back, that step's tokens, on the device: greedy outputs with
    them equal those without speculation, with steps planned ahead of verify steps."""
    from tests.engine.drafting import generate_recorded

    model, fields = on_device_case(name, llama, deepseek_successor)
    stop = reference(model)[0][3]  # a token the first prompt's output soon reaches
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, **extra)
        for extra in (dict(frequency_penalty=0.7), dict(repetition_penalty=1.4),
                      dict(presence_penalty=0.9), dict(min_tokens=12, stop_token_ids=[stop]),
                      dict(frequency_penalty=0.3, min_tokens=8, stop_token_ids=[stop]),
                      dict())
    ]  # fmt: skip
    expected = [r.token_ids for r in engine(model).generate(prompts(), params)]
    assert expected != reference(model)  # the penalties changed something
    spec = SpeculativeConfig(num_speculative_tokens=3, schedule="fixed", **fields)
    run = generate_recorded(engine(model, spec, overlap_scheduling=True), prompts(), params)
    assert run.outputs == expected
    assert run.early > 5


@pytest.mark.parametrize("name", ["draft-self", "mtp-kept"])
def test_drafts_made_on_the_device_go_two_past_the_verified_and_the_next_plan_stays_within(
    name, llama, deepseek_successor
):
    """A drafter on the device drafts behind a step no deeper than ``draft_depth`` of what
    each request verifies in it, and the step planned before those drafts exist verifies
    no more of them than were made; outputs stay those without speculation. The policy
    asks for 4, 1, 4, 0, 2 drafts in turn (as far as each request's candidates go)."""
    from engine.request import UNRESOLVED
    from engine.spec.base import draft_depth

    cycle = (4, 1, 4, 0, 2)
    model, fields = on_device_case(name, llama, deepseek_successor)
    if "confidence_temperatures" in fields:  # one a draft position
        fields = {**fields, "confidence_temperatures": (0.3,) * 4}
    spec = SpeculativeConfig(num_speculative_tokens=4, schedule="dynamic", **fields)
    llm = engine(model, spec, overlap_scheduling=True)
    drafter, scheduler = llm.core.runner.drafter, llm.core.scheduler
    launch, schedule = drafter.launch, scheduler.schedule
    asked, depths, made, past = [0], [], {}, [0]

    def lengths(step):  # 4, 1, 4: asks three more than the step before verified
        asked[0] += 1
        return [min(cycle[(asked[0] + i) % 5], len(c)) for i, c in enumerate(step.curves)]

    def launched(step):
        verified = {c.request_id: c.num_draft for c in step.chunks}
        made.clear()
        for r in step.requests:
            depths.append((r.num_draft, verified[r.request_id]))
            made[r.request_id] = r.num_draft
        return launch(step)

    def planned():
        plan = schedule()
        for c in plan.chunks:
            drafted = sum(t < UNRESOLVED for t in c.token_ids)  # placeholders of drafts
            past[0] += drafted > made.get(c.request_id, 0)
        return plan

    scheduler.spec.policy.lengths = lengths
    drafter.launch, scheduler.schedule = launched, planned
    outputs = [r.token_ids for r in llm.generate(prompts(), GREEDY)]
    assert outputs == reference(model)
    assert past[0] == 0
    assert all(d <= draft_depth(v, 4) for d, v in depths)
    assert {(d, v) for d, v in depths if d == draft_depth(v, 4)} >= {(4, 0), (3, 1), (4, 2)}
    llm.core.check_integrity()
