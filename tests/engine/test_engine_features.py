"""Request features on the real engine: stop strings, seeds, queue bound, KV release, limits, logprobs."""

import asyncio

import pytest
import torch

from specserve.config.schema import EngineConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.errors import InvalidRequestError, QueueFullError, RequestTooLongError
from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_core, run

PROMPT = "The quick brown fox"


def _greedy(core, **kw):
    return run(core, [PROMPT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw))[0]


@pytest.mark.parametrize("spec", [False, True])
def test_stop_string_across_token_boundary(tiny, spec):
    core = make_core(tiny["llama"], tiny["llama_draft"] if spec else None, k=3)
    full = _greedy(core)
    tok = core.tokenizer
    pieces = [tok.decode(full.output_token_ids[: i + 1]) for i in range(len(full.output_token_ids))]
    # a stop string made of the last char of token i's text and the first char of token i+1's text
    for i in range(1, len(pieces) - 1):
        a, b = pieces[i], pieces[i + 1]
        clean = full.text.startswith(b) and len(b) > len(a) > len(pieces[i - 1]) and not b.endswith("\ufffd")
        if clean and "\ufffd" not in a[-1] + b[len(a)]:
            stop, cut = a[-1] + b[len(a)], len(a) - 1
            if full.text.find(stop) == cut:
                break
    else:
        raise AssertionError(f"no clean token boundary in {full.text!r}")
    out = _greedy(core, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert out.output_token_ids == full.output_token_ids[: i + 2]
    assert core.allocator.usage == 0.0


def test_eos_and_stop_token_ids(tiny):
    core = make_core(tiny["llama"])
    full = _greedy(core)
    stop_tok = full.output_token_ids[5]
    out = run(core, [PROMPT], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop"
    assert out.output_token_ids == full.output_token_ids[: full.output_token_ids.index(stop_tok) + 1]


@pytest.mark.parametrize("draft", [None, "llama_draft"])
def test_seeded_output_independent_of_batch(tiny, draft):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    alone = run(make_core(tiny["llama"], tiny[draft] if draft else None, k=3), [PROMPT], seeded)[0]
    others = ["def main():", "café", "x y z", "Speculative decoding proposes"]
    params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 4 + [seeded]
    crowd = run(make_core(tiny["llama"], tiny[draft] if draft else None, k=3, seed=99), others + [PROMPT], params,
                join_after=2, join_from=2)
    assert crowd[-1].output_token_ids == alone.output_token_ids
    assert crowd[-1].text == alone.text


def test_kv_released_after_finish_and_abort(tiny):
    core = make_core(tiny["llama"], tiny["llama_draft"], k=3)
    for i in range(3):
        core.add_request(core.make_request(f"a{i}", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True)))
    core.step()
    core.step()
    assert core.allocator.usage > 0
    outs = [core.abort(f"a{i}") for i in range(3)]
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    assert core.allocator.usage == 0.0 and not core.has_unfinished()
    run(core, [PROMPT] * 3, SamplingParams(max_tokens=8))
    assert core.allocator.usage == 0.0


def test_duplicate_ids_and_limits(tiny):
    """(The waiting-queue limit is AsyncEngine's admission control: tests/api test the 429.)"""
    core = make_core(tiny["llama"], max_queue_len=2, max_model_len=64)
    core.add_request(core.make_request("q0", PROMPT, SamplingParams()))
    with pytest.raises(InvalidRequestError) as err:
        core.add_request(core.make_request("q0", PROMPT, SamplingParams()))
    assert err.value.param == "request_id"
    with pytest.raises(RequestTooLongError) as err:
        core.make_request("long", [1] * 64, SamplingParams())
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(RequestTooLongError) as err:
        core.make_request("long2", [1] * 10, SamplingParams(max_tokens=60))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError):
        core.make_request("bad", [10 ** 6], SamplingParams())
    with pytest.raises(InvalidRequestError):
        core.make_request("empty", [], SamplingParams())


def test_request_that_never_fits_kv_is_refused(tiny):
    core = make_core(tiny["llama"], block_size=4, kv_cache_memory=4 * 4 * 512)  # 4 blocks = 16 tokens
    with pytest.raises(RequestTooLongError, match="KV cache"):
        core.make_request("big", [1] * 10, SamplingParams(max_tokens=10))
    assert run(core, [[1] * 5], SamplingParams(max_tokens=8, ignore_eos=True))[0].finish_reason == "length"


def test_logprobs_of_raw_target_logits(tiny):
    core = make_core(tiny["llama"], tiny["llama_draft"], k=3)
    out = _greedy(core, logprobs=3)
    assert len(out.logprobs) == len(out.output_token_ids)
    model = core.target.model
    ids = torch.tensor([out.prompt_token_ids + out.output_token_ids])
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32)
    with torch.no_grad():
        logsm = torch.log_softmax(ref(ids).logits[0].float(), -1)
    n = len(out.prompt_token_ids)
    for j, lp in enumerate(out.logprobs):
        row = logsm[n - 1 + j]
        assert lp.token_id == out.output_token_ids[j]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert lp.top[0][0] == lp.token_id  # greedy: the chosen token is the most likely one
    del model


def test_async_engine_streams_deltas_and_aborts(tiny):
    async def main():
        engine = AsyncEngine(EngineConfig(model=str(tiny["llama"]), draft_model=str(tiny["llama_draft"]),
                                          num_speculative_tokens=3, dtype="float32", device="cpu",
                                          kv_cache_memory=1 << 24, max_queue_len=4, seed=0))
        await engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

        async def collect(prompt, rid):
            deltas, last = [], None
            async for out in engine.generate(prompt, params, request_id=rid):
                deltas.append(out.delta_text)
                last = out
            return "".join(deltas), last

        results = await asyncio.gather(*(collect(p, f"s{i}") for i, p in enumerate([PROMPT, "café", "def"])))
        for text, last in results:
            assert last.finished and text == last.text and len(last.output_token_ids) == 20
        # a consumer that walks away mid-stream aborts its request and frees its KV
        gen = engine.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), request_id="gone")
        await gen.__anext__()
        await gen.aclose()
        for _ in range(100):
            if engine.stats().kv_cache_usage == 0.0 and engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.02)
        assert engine.stats().kv_cache_usage == 0.0
        assert engine.health().ready
        await engine.shutdown()
        assert engine.health().state == "stopped"

    asyncio.run(main())


def test_async_engine_queue_full(tiny):
    async def main():
        engine = AsyncEngine(EngineConfig(model=str(tiny["llama"]), dtype="float32", device="cpu",
                                          kv_cache_memory=1 << 24, max_queue_len=1, max_num_seqs=1))
        await engine.start()
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        running = engine.generate(PROMPT, params, request_id="g0")
        await running.__anext__()  # g0 holds the only running slot
        waiting = asyncio.ensure_future(engine.generate(PROMPT, params, request_id="g1").__anext__())
        await asyncio.sleep(0.05)  # g1 is submitted and waits
        with pytest.raises(QueueFullError):
            await engine.generate(PROMPT, params, request_id="g2").__anext__()
        await running.aclose()  # frees the slot: g1 runs
        assert (await waiting).request_id == "g1"
        await engine.shutdown()

    asyncio.run(main())


def test_slow_reader_gets_merged_outputs_not_a_growing_queue(tiny):
    async def main():
        engine = AsyncEngine(EngineConfig(model=str(tiny["llama"]), draft_model=str(tiny["llama_draft"]),
                                          num_speculative_tokens=3, dtype="float32", device="cpu",
                                          kv_cache_memory=1 << 24, seed=0))
        await engine.start()
        stream = engine.submit(PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        first = await stream.__anext__()
        for _ in range(200):  # stop reading until the request has finished in the engine
            if engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.02)
        assert isinstance(stream._pending, type(first))  # one held output, not a queue of them
        rest = [out async for out in stream]
        await engine.shutdown()
        return first, rest

    first, rest = asyncio.run(main())
    assert len(rest) == 1 and rest[0].finished  # everything after the first read arrived merged
    assert first.delta_token_ids + rest[0].delta_token_ids == rest[0].output_token_ids
    assert first.delta_text + rest[0].delta_text == rest[0].text


def test_max_num_seqs_is_respected_every_step(tiny):
    core = make_core(tiny["llama"], tiny["llama_draft"], k=2, max_num_seqs=3)
    for i in range(8):
        core.add_request(core.make_request(f"m{i}", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True)))
    finished, peak = 0, 0
    while core.has_unfinished():
        finished += sum(o.finished for o in core.step())
        peak = max(peak, core.last_step.num_running)
        assert core.last_step.num_running <= 3
    assert finished == 8 and peak == 3
