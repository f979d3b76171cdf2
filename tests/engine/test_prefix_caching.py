"""Automatic prefix caching in the engine (fp32): greedy identity with caching on vs off (speculation, preemption,
requests sharing a prefix while running), proposer KV validity on hits (the target as its own draft keeps
acceptance at 1.0, which greedy identity cannot see), eviction, reference counts, cached_tokens, salts, and that the
target never writes into a published block."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import drive, make_core, run
from tests.engine.test_dflash import fresh_context_kv, save_random

SYSTEM = ("You are a careful assistant. Answer briefly, cite the document when you can, and never invent facts. "
          "The document follows: speculative decoding drafts tokens cheaply and verifies them with one forward. ")
QUESTIONS = ["What is drafted?", "Who verifies?", "How many forwards?", "Is it exact?", "Why cheap?",
             "What follows?"]
PROMPTS = [SYSTEM + q for q in QUESTIONS]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def assert_pool_whole(core):
    alloc = core.allocator
    alloc.check_whole()
    assert all(alloc.ref_count(b) == 0 for b in range(alloc.num_blocks)) and alloc.usage == 0.0
    assert not core.has_unfinished()


@pytest.fixture(scope="module")
def baseline(tiny):
    core = make_core(tiny["llama"], enable_prefix_caching=False)
    return [o.output_token_ids for o in run(core, PROMPTS, GREEDY)]


def waves(params=GREEDY):
    """The first prompt alone, then two that share its prefix while it runs, then the rest after it finished."""
    return [(0, PROMPTS[0], params), (2, PROMPTS[1], params), (2, PROMPTS[2], params),
            *[(40, p, params) for p in PROMPTS[3:]]]


@pytest.mark.parametrize("draft", [None, "llama_draft", "self"])
def test_greedy_identical_with_caching_on_and_off(tiny, baseline, draft):
    draft_path = None if draft is None else tiny["llama"] if draft == "self" else tiny[draft]
    core = make_core(tiny["llama"], draft_path, k=3, block_size=4)
    outs = drive(core, waves())
    assert [o.output_token_ids for o in outs] == baseline
    prompt_len = len(outs[0].prompt_token_ids)
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= len(core.tokenize(SYSTEM)) - 4 for o in outs[1:])
    assert all(o.num_cached_tokens < prompt_len for o in outs)
    assert core.totals.prefix_cache_hits == sum(o.num_cached_tokens for o in outs)
    assert core.totals.prefix_cache_queries == sum(len(o.prompt_token_ids) for o in outs)
    if draft == "self":
        drafted = sum(o.speculation.num_draft_tokens for o in outs)
        assert drafted > 0 and sum(o.speculation.num_accepted_tokens for o in outs) == drafted
    assert_pool_whole(core)


def test_caching_off_reuses_nothing(tiny, baseline):
    core = make_core(tiny["llama"], block_size=4, enable_prefix_caching=False)
    outs = drive(core, waves())
    assert [o.output_token_ids for o in outs] == baseline
    assert all(o.num_cached_tokens == 0 for o in outs) and core.allocator.num_cached == 0


def test_preemption_with_shared_prefixes_stays_identical(tiny, baseline):
    # 60 blocks of 4 tokens (target 512 B + draft 128 B per token, fp32) cannot hold six ~180-token requests, even
    # with their ~150-token prefix shared
    core = make_core(tiny["llama"], tiny["llama_draft"], k=3, block_size=4, max_num_batched_tokens=16,
                     kv_cache_memory=60 * 4 * (512 + 128))
    outs = drive(core, [(0, p, GREEDY) for p in PROMPTS])
    assert [o.output_token_ids for o in outs] == baseline
    assert core.totals.num_preemptions > 0
    assert_pool_whole(core)


def test_self_draft_accepts_everything_on_hits_with_and_without_cached_draft_kv(tiny):
    """The target as its own draft: a hit that reuses the draft's KV (marked valid once the draft caught up) and a
    hit on blocks a k = 0 request published (draft KV absent: the draft recomputes it) both keep acceptance at 1.0;
    reading a block whose draft KV was never written would not."""
    core = make_core(tiny["llama"], tiny["llama"], k=3, block_size=4)
    hits = []
    on_hit = core.proposers["draft"].on_cache_hit
    core.proposers["draft"].on_cache_hit = lambda req, n: (hits.append((req.request_id, n)), on_hit(req, n))
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_speculative_tokens=0)
    first = drive(core, [(0, PROMPTS[0], plain)])[0]
    assert first.speculation.num_draft_tokens == 0
    second = drive(core, [(0, PROMPTS[1], GREEDY)])[0]  # hits blocks with no draft KV
    third = drive(core, [(0, PROMPTS[2], GREEDY)])[0]  # hits blocks whose draft KV the second filled in
    assert len(hits) == 2 and second.num_cached_tokens > 0 and third.num_cached_tokens > 0
    assert hits[0][1] == 0  # the second's hit held no draft KV: its draft recomputed it
    assert hits[1][1] == third.num_cached_tokens  # the third reused the draft KV the second filled in
    for out in (second, third):
        assert out.speculation.num_draft_tokens > 0
        assert out.speculation.num_accepted_tokens == out.speculation.num_draft_tokens
    assert_pool_whole(core)


def test_evicted_prefix_is_recomputed_correctly(tiny, baseline):
    core = make_core(tiny["llama"], block_size=4, kv_cache_memory=60 * 4 * 512)  # 60 blocks
    first = drive(core, [(0, PROMPTS[0], GREEDY)])[0]
    others = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)] * 2
    drive(core, [(0, "x" * 70 + str(i), sp) for i, sp in enumerate(others)])  # fills the pool: evicts the prefix
    again = drive(core, [(0, PROMPTS[0], GREEDY)])[0]
    assert again.output_token_ids == first.output_token_ids == baseline[0]
    assert again.num_cached_tokens < len(core.tokenize(SYSTEM)) - 4
    assert_pool_whole(core)


def test_whole_prompt_hit_recomputes_the_last_token_in_a_private_copy(tiny):
    core = make_core(tiny["llama"], block_size=4)
    prompt = list(range(5, 5 + 32))  # 8 full blocks
    first = drive(core, [(0, prompt, GREEDY)])[0]
    written = []
    run_target = core.target.run

    def spy(input_ids, chunks, *args, **kw):
        for c in chunks:
            written.extend(c.block_table[p // 4] for p in range(c.start, c.start + c.num_new))
        return run_target(input_ids, chunks, *args, **kw)
    core.target.run = spy
    again = drive(core, [(0, prompt, GREEDY), (0, prompt, GREEDY)])
    assert [o.output_token_ids for o in again] == [first.output_token_ids] * 2
    assert [o.num_cached_tokens for o in again] == [31, 31]  # all but the last token
    assert core.totals.num_prompt_tokens == 32 + 1 + 1
    cached = core.allocator.cached_blocks
    assert written and not cached & set(written[:2])  # the last token went into private copies
    assert_pool_whole(core)


def test_a_published_block_is_never_written_by_the_target(tiny):
    core = make_core(tiny["llama"], tiny["llama_draft"], k=3, block_size=4, max_num_batched_tokens=16,
                     kv_cache_memory=60 * 4 * (512 + 128))
    bad, run_target = [], core.target.run

    def spy(input_ids, chunks, *args, **kw):
        published = core.allocator.cached_blocks
        for c in chunks:
            blocks = {c.block_table[p // 4] for p in range(c.start, c.start + c.num_new)}
            bad.extend(blocks & published)
        return run_target(input_ids, chunks, *args, **kw)
    core.target.run = spy
    drive(core, [(i % 3 * 5, p, GREEDY) for i, p in enumerate(PROMPTS * 2)])
    assert core.totals.prefix_cache_hits > 0 and core.totals.num_preemptions > 0
    assert not bad
    assert_pool_whole(core)


def test_different_salts_never_share(tiny):
    core = make_core(tiny["llama"], block_size=4)
    a = SamplingParams(temperature=0.0, max_tokens=4, cache_salt="tenant-a")
    b = SamplingParams(temperature=0.0, max_tokens=4, cache_salt="tenant-b")
    outs = drive(core, [(0, PROMPTS[0], a), (10, PROMPTS[1], b), (20, PROMPTS[2], a)])
    assert outs[1].num_cached_tokens == 0 and outs[2].num_cached_tokens > 0


def test_abort_while_sharing_keeps_the_cache_consistent(tiny, baseline):
    core = make_core(tiny["llama"], tiny["llama_draft"], k=3, block_size=4)
    reqs = [core.make_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:3])]
    for r in reqs:
        core.add_request(r)
    for _ in range(3):
        core.step()
    core.abort("r1")
    final = {}
    while core.has_unfinished():
        final.update({o.request_id: o for o in core.step() if o.finished})
    assert [final["r0"].output_token_ids, final["r2"].output_token_ids] == [baseline[0], baseline[2]]
    assert_pool_whole(core)
    again = drive(core, [(0, PROMPTS[1], GREEDY)])[0]
    assert again.output_token_ids == baseline[1] and again.num_cached_tokens > 0


def test_dflash_context_on_hits_equals_a_fresh_computation(tiny, tmp_path, baseline):
    """DFlash's context K/V is cached with the target's blocks: a hit reuses it where it is valid; blocks published
    by a request without DFlash carry none, so a DFlash request's hit stops there and the target recomputes."""
    drafter = save_random(tiny["llama"], tmp_path / "b4")
    core = make_core(tiny["llama"], speculative_method="dflash", k=3, draft=drafter, block_size=4)
    dflash = core.proposers["dflash"]
    target = AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32).eval()
    checked, propose = [], dflash.propose

    def spy(requests, ks, generator):
        live = [r for r in requests if dflash._valid.get(r.request_id) == len(r.token_ids) - 1]
        if live:
            pooled, _, _ = dflash._gather_context(live, torch.tensor([len(r.token_ids) - 1 for r in live]))
            for i, r in enumerate(live):
                n = len(r.token_ids) - 1
                for (k, v), (fk, fv) in zip(pooled, fresh_context_kv(target, dflash.drafter, r.token_ids)):
                    torch.testing.assert_close(k[i, :n], fk, atol=1e-4, rtol=1e-4)
                    torch.testing.assert_close(v[i, :n], fv, atol=1e-4, rtol=1e-4)
                checked.append(r.request_id)
        return propose(requests, ks, generator)
    dflash.propose = spy
    none = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, speculative_method="none")
    outs = drive(core, [(0, PROMPTS[0], none), (30, PROMPTS[1], GREEDY), (60, PROMPTS[2], GREEDY),
                        (61, PROMPTS[3], GREEDY)])
    assert [o.output_token_ids for o in outs] == baseline[:4]
    assert outs[1].num_cached_tokens == 0  # the first request's blocks hold no DFlash context
    assert outs[2].num_cached_tokens > 0 and outs[3].num_cached_tokens > 0  # the second's do
    assert len(checked) > 10
    assert_pool_whole(core)
