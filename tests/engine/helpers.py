"""Helpers to drive EngineCore directly: staggered arrivals, run to completion."""

from __future__ import annotations

from config.schema import EngineConfig
from engine.core import EngineCore
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams


def make_core(model, draft=None, k=4, **kw) -> EngineCore:
    kw.setdefault("kv_cache_memory", 1 << 24)
    kw.setdefault("seed", 0)
    return EngineCore(EngineConfig(model=str(model), draft_model=str(draft) if draft else None,
                                   num_speculative_tokens=k if draft or "speculative_method" in kw else 0,
                                   dtype=kw.pop("dtype", "float32"),
                                   device=kw.pop("device", "cpu"), **kw))


def run(core: EngineCore, prompts, params: SamplingParams | list[SamplingParams], join_after: int | None = None,
        join_from: int | None = None) -> list[RequestOutput]:
    """Run prompts to completion; with join_after, prompts[join_from:] arrive after `join_after` steps."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [core.make_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    split = len(reqs) if join_after is None else (join_from if join_from is not None else len(reqs) // 2)
    for r in reqs[:split]:
        core.add_request(r)
    final: dict[str, RequestOutput] = {}
    steps = 0
    while len(final) < len(reqs):
        if steps == join_after:
            for r in reqs[split:]:
                core.add_request(r)
        for out in core.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        assert steps < 10_000
    return [final[r.request_id] for r in reqs]


def bundled_method_outputs(method: str, k: int, max_tokens: int = 32) -> list[RequestOutput]:
    """What `specserve serve --speculative-method METHOD` runs on the demo target (fp32 here), its bundled proposer
    found without a flag: four held-out chat questions in one batch must equal plain decoding. -> the outputs."""
    from engine import LLM
    from engine.train.chat_prompts import heldout_prompts

    llm = LLM(speculative_method=method, dtype="float32", kv_cache_memory=64 << 20, seed=0)
    chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=False) for p in heldout_prompts()[:4]]
    plain = llm.generate(chats, SamplingParams(temperature=0, max_tokens=max_tokens, num_speculative_tokens=0))
    outs = llm.generate(chats, SamplingParams(temperature=0, max_tokens=max_tokens, num_speculative_tokens=k))
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in plain]
    assert all(o.speculation.method == method for o in outs)
    return outs
