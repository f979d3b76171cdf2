"""Helpers to drive EngineCore directly: staggered arrivals, run to completion."""

from __future__ import annotations

from specserve.config.schema import EngineConfig
from specserve.engine.core import EngineCore
from specserve.engine.request import RequestOutput
from specserve.engine.sampling_params import SamplingParams


def make_core(model, draft=None, k=4, **kw) -> EngineCore:
    """`cost_source=ModelCosts(...)` makes adaptive k's decisions independent of this machine's speed."""
    kw.setdefault("kv_cache_memory", 1 << 24)
    kw.setdefault("seed", 0)
    costs = kw.pop("cost_source", None)
    return EngineCore(EngineConfig(model=str(model), draft_model=str(draft) if draft else None,
                                   num_speculative_tokens=k if draft or "speculative_method" in kw else 0,
                                   dtype=kw.pop("dtype", "float32"),
                                   device=kw.pop("device", "cpu"), **kw), costs)


class ModelCosts:
    """A CostSource for tests: a target forward costs `base + per_token * tokens + per_padded * padded slots`
    seconds, a proposal `draft[method] * positions`, whatever the wall clock said."""

    def __init__(self, base: float = 0.020, per_token: float = 0.0004, draft: dict[str, float] | None = None,
                 per_padded: float = 0.0):
        self.base, self.per_token, self.draft, self.per_padded = base, per_token, draft or {}, per_padded

    def forward(self, num_tokens: int, padded: int, measured: float) -> float:
        return self.base + self.per_token * num_tokens + self.per_padded * padded

    def propose(self, method: str, num_positions: int, num_rows: int, measured: float) -> float:
        return self.draft.get(method, 0.0) * num_positions


def run(core: EngineCore, prompts, params: SamplingParams | list[SamplingParams], join_after: int | None = None,
        join_from: int | None = None) -> list[RequestOutput]:
    """Run prompts to completion; with join_after, prompts[join_from:] arrive after `join_after` steps."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    split = len(prompts) if join_after is None else (join_from if join_from is not None else len(prompts) // 2)
    return drive(core, [(0 if i < split else join_after, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])


def drive(core: EngineCore, arrivals: list[tuple[int, object, SamplingParams]]) -> list[RequestOutput]:
    """arrivals: (step at which it joins, prompt, params) -> final outputs in arrival order (ids r0, r1, ...)."""
    reqs = [(at, core.make_request(f"r{i}", p, sp)) for i, (at, p, sp) in enumerate(arrivals)]
    final: dict[str, RequestOutput] = {}
    step = 0
    while len(final) < len(reqs):
        for at, r in reqs:
            if at == step:
                core.add_request(r)
        for out in core.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
        assert step < 10_000
    return [final[r.request_id] for _, r in reqs]


def bundled_method_outputs(method: str, k: int, max_tokens: int = 32) -> list[RequestOutput]:
    """What `specserve serve --speculative-method METHOD` runs on the demo target (here in fp32 and dequantised, as
    before int4 became the demo's default on CPU; speculation on int4 targets is tested in test_quantization.py), its
    bundled proposer found without a flag: four held-out chat questions in one batch must equal plain decoding.
    -> the outputs."""
    from bench.prompts import heldout_prompts
    from specserve.engine import LLM

    llm = LLM(speculative_method=method, dtype="float32", quantization="none", kv_cache_memory=64 << 20, seed=0)
    chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=False) for p in heldout_prompts()[:4]]
    plain = llm.generate(chats, SamplingParams(temperature=0, max_tokens=max_tokens, num_speculative_tokens=0))
    outs = llm.generate(chats, SamplingParams(temperature=0, max_tokens=max_tokens, num_speculative_tokens=k))
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in plain]
    assert all(o.speculation.method == method for o in outs)
    return outs
