"""The cost of grammar-constrained decoding per token: mask computation and application, at batch 1 and 16, with
and without speculation, on the same engine and in the same run.

For each (batch, method) it generates JSON under a bounded JSON Schema (greedy, the grammar ends each answer) and
times, inside the engine, every call that builds or applies a grammar mask (the target's per-row masks of a step,
the draft model's masks while drafting, the matcher advancing over emitted tokens). It reports tokens/s, that
grammar time per generated token and its share of the wall time; and tokens/s of the same prompts without a
grammar, each cut at the length of its JSON answer (the same number of steps; a different text, and with
speculation a different acceptance, so compare the "none" rows for the grammar's own cost).

    python -m bench.structured --batch-sizes 1,16 --repeats 2 --out structured.json
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

import torch

import specserve.engine.core
import specserve.engine.spec_decode.draft_sampling
from bench.output import emit
from bench.prompts import heldout_prompts
from bench.spec_decode import machine_info
from specserve.engine import LLM, SamplingParams
from specserve.engine.sample.grammar import GrammarSpec

SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 40}, "summary": {"type": "string", "maxLength": 80},
    "difficulty": {"enum": ["easy", "medium", "hard"]}, "steps": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["topic", "summary", "difficulty", "steps"], "additionalProperties": False}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--methods", default="none,draft", help="comma-separated: none and/or the server's method")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none",
                    help="none (default: the dtype's weights, as docs/ measured) | auto (the server's default) | int8 | int4")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


class GrammarClock:
    """Wraps the engine's grammar entry points with a timer (the bench's own engine only; restored on exit)."""

    TARGETS = [(specserve.engine.core, "verify_bitmasks"), (specserve.engine.core, "apply_bitmask"),
               (specserve.engine.core, "advance_grammar"),
               (specserve.engine.spec_decode.draft_sampling.ChainSampler, "_constrained")]

    def __init__(self):
        self.seconds = 0.0
        self._saved = []

    def __enter__(self):
        for owner, name in self.TARGETS:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._timed(original))
        return self

    def __exit__(self, *exc):
        for owner, name, original in self._saved:
            setattr(owner, name, original)

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return wrapper


def prompts_for(llm: LLM, batch: int) -> list[str]:
    qs = heldout_prompts()
    return [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe this task as JSON (topic, summary, difficulty, steps): {q}"}],
        add_generation_prompt=True, tokenize=False) for q in (qs * (batch // len(qs) + 1))[:batch]]


def run_case(llm: LLM, prompts: list[str], method: str, grammar: bool, max_tokens: int,
             lengths: list[int] | None = None):
    """lengths: free text, each prompt cut at the length its JSON answer had (so the batch runs as many steps)."""
    k = {"num_speculative_tokens": 0} if method == "none" else {}
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA)) if grammar else None
    salt = uuid.uuid4().hex  # every run cold (no prefix-cache hits from the previous run)
    params = [SamplingParams(temperature=0.0, max_tokens=n, structured=spec, ignore_eos=not grammar, cache_salt=salt,
                             **k) for n in (lengths or [max_tokens] * len(prompts))]
    with GrammarClock() as clock:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
    return {"seconds": wall, "tokens": sum(len(o.output_token_ids) for o in outs), "grammar_seconds": clock.seconds,
            "valid": sum(_valid(o.text) for o in outs) if grammar else None,
            "lengths": [len(o.output_token_ids) for o in outs]}


def _valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and set(obj) == set(SCHEMA["required"])


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization, seed=0)
    llm.generate(["warm up"] * 2, SamplingParams(temperature=0.0, max_tokens=8))
    # the schema's first masks build llguidance's lexer lazily (a one-time cost per schema): not per token
    run_case(llm, prompts_for(llm, 1), "none", True, args.max_tokens)
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = prompts_for(llm, batch)
        for method in args.methods.split(","):
            reps = []
            for _ in range(args.repeats):
                g = run_case(llm, prompts, method, True, args.max_tokens)
                free = run_case(llm, prompts, method, False, args.max_tokens, lengths=g["lengths"])
                reps.append((g, free))
            gt, gs = sum(g["tokens"] for g, _ in reps), sum(g["seconds"] for g, _ in reps)
            gram = sum(g["grammar_seconds"] for g, _ in reps)
            ft, fs = sum(f["tokens"] for _, f in reps), sum(f["seconds"] for _, f in reps)
            rows.append({"batch": batch, "method": method, "tokens_per_s": gt / gs, "free_tokens_per_s": ft / fs,
                         "grammar_ms_per_token": 1000 * gram / gt, "grammar_share": gram / gs,
                         "valid": f"{sum(g['valid'] for g, _ in reps)}/{batch * args.repeats}",
                         "mean_tokens": gt / (batch * args.repeats)})
    report = {"benchmark": "structured", "machine": machine_info(llm.engine.device), "dtype": str(llm.engine.dtype),
              "args": vars(args), "schema": SCHEMA, "rows": rows}
    lines = [f"machine: {report['machine']['cpu']} | threads {report['machine']['torch_threads']} | {report['dtype']}",
             "", "| batch | method | tok/s (JSON schema) | grammar ms / token | grammar share of wall | valid | "
             "mean tokens | tok/s (free text, same lengths) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['grammar_ms_per_token']:.2f} | "
                     f"{100 * r['grammar_share']:.1f}% | {r['valid']} | {r['mean_tokens']:.0f} | "
                     f"{r['free_tokens_per_s']:.1f} |")
    emit(report, args.out, "\n".join(lines))
    return report


if __name__ == "__main__":
    main()
