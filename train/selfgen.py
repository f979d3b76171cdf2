"""Self-distillation data: the target answers chat prompts on the engine itself (continuous batching, plain
decoding) and the set keeps prompt ids, output ids and the target's top-k log-probs per output position.

Shards (`shard_00000.pt`, ...) go to a directory outside git; a rerun resumes after the last shard. Pass 0 answers
even prompts greedily and odd ones at temperature 0.8; pass 1 the other way round (odd greedy, even at 1.0), so two
passes give every prompt a greedy answer and a sampled one; later passes sample at 1.0. A record's `index` is
pass * num_prompts + prompt index (unique), its `prompt_index` the prompt's (held-out splits use that one).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from specserve.config.schema import EngineConfig
from specserve.engine.core import EngineCore
from specserve.engine.sampling_params import SamplingParams
from specserve.train.prompts import training_prompts


def chat_text(tokenizer, user: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                         tokenize=False)


def _done_indices(out: Path) -> set[int]:
    return {r["index"] for shard in sorted(out.glob("shard_*.pt")) for r in torch.load(shard)}


def _temperature(pass_: int, i: int) -> float:
    if pass_ >= 2:
        return 1.0
    if i % 2 == pass_:
        return 0.0
    return 0.8 if pass_ == 0 else 1.0


def generate_set(model: str, out: str | Path, max_minutes: float, max_tokens: int = 192, top_k: int = 20,
                 batch: int = 48, shard_size: int = 256, seed: int = 0, dtype: str = "auto", passes: int = 1) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    engine = EngineCore(EngineConfig(model=model, num_speculative_tokens=0, dtype=dtype, max_num_seqs=batch,
                                     seed=seed, kv_cache_memory=2 << 30))
    prompts = training_prompts(seed)
    done = _done_indices(out)
    n = len(prompts)
    todo = [j for j in range(passes * n) if j not in done]
    deadline = time.monotonic() + max_minutes * 60
    pending, records, shard = {}, [], len(list(out.glob("shard_*.pt")))
    t0, tokens = time.monotonic(), 0

    def flush() -> None:
        nonlocal records, shard
        if records:
            torch.save(records, out / f"shard_{shard:05d}.pt")
            shard += 1
            records = []
        (out / "info.json").write_text(json.dumps({"model": model, "top_k": top_k, "max_tokens": max_tokens,
                                                   "num_training_prompts": n, "seed": seed,
                                                   "passes": passes}))

    while todo or pending:
        while len(pending) < batch and todo and time.monotonic() < deadline:
            j = todo.pop(0)
            params = SamplingParams(temperature=_temperature(*divmod(j, n)), max_tokens=max_tokens, logprobs=top_k,
                                    seed=seed + j)
            req = engine.make_request(f"gen-{j}", chat_text(engine.tokenizer, prompts[j % n]), params)
            engine.add_request(req)
            pending[req.request_id] = j
        if not pending:
            break
        for o in engine.step():
            if not o.finished or o.request_id not in pending:
                continue
            j = pending.pop(o.request_id)
            if o.finish_reason not in ("stop", "length") or not o.logprobs:
                continue
            records.append({
                "index": j, "prompt_index": j % n, "prompt_ids": torch.tensor(o.prompt_token_ids, dtype=torch.int32),
                "output_ids": torch.tensor(o.output_token_ids, dtype=torch.int32),
                "top_ids": torch.tensor([[t for t, _ in lp.top] for lp in o.logprobs], dtype=torch.int32),
                "top_logprobs": torch.tensor([[v for _, v in lp.top] for lp in o.logprobs], dtype=torch.float16),
                "temperature": _temperature(*divmod(j, n)), "finish_reason": o.finish_reason})
            done.add(j)
            tokens += len(o.output_token_ids)
            if len(records) >= shard_size:
                flush()
                rate = tokens / (time.monotonic() - t0)
                print(f"[selfgen] {len(done)}/{len(prompts)} prompts, {tokens} tokens, {rate:.0f} tok/s", flush=True)
    flush()
    summary = {"num_prompts": len(done), "tokens_this_run": tokens,
               "seconds": round(time.monotonic() - t0, 1), "out": str(out)}
    print(f"[selfgen] {summary}", flush=True)
    return summary
