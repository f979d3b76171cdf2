"""Adaptive k against every fixed k, in one run: for each loaded method and concurrency, rounds in which plain
decoding, each fixed k (chains: 1..4; tree methods: node budgets) and `auto` each decode the same prompts, in a
seeded shuffled order per round so that no setting always runs first or last. Reports per method and concurrency
the median tokens/s of each setting, auto / best fixed and auto / plain (medians of the per-round ratios), and the
histogram of the k auto chose.

`python -m bench.adaptive --eagle3 --concurrency 1,4,16,32 --rounds 3 --max-tokens 64 [--out docs/adaptive.json]`

Prints JSON (stdout or --out) and a markdown table (stderr).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter

import torch

from bench.output import emit
from bench.prompts import heldout_prompts
from bench.spec_decode import machine_info
from specserve.engine import LLM, SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.adaptive", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (default: the demo target)")
    ap.add_argument("--methods", default="draft,ngram", help="comma-separated methods to load (auto k each)")
    ap.add_argument("--eagle3", action="store_true", help="also load EAGLE-3 (the demo target's bundled drafter)")
    ap.add_argument("--medusa", action="store_true", help="also load Medusa (the bundled heads)")
    ap.add_argument("--dflash", action="store_true", help="also load DFlash (the bundled drafter)")
    ap.add_argument("--chain-ks", default="1,2,3,4", help="the fixed k of chain methods")
    ap.add_argument("--tree-ks", default="4,8,16,31", help="the fixed node budgets of tree methods (capped)")
    ap.add_argument("--max-k", type=int, default=4, help="max_speculative_tokens of the chain methods' auto")
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m.strip()]
    args.methods += [m for m in ("medusa", "dflash", "eagle3") if getattr(args, m) and m not in args.methods]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    return args


def settings_for(k_max: int, tree: bool, chain_ks: list[int], tree_ks: list[int]) -> list[str]:
    """"plain", "k=N" for each fixed k within the method's reach, "auto". Pure."""
    ks = sorted({min(k, k_max) for k in (tree_ks if tree else chain_ks)})
    return ["plain", *[f"k={k}" for k in ks], "auto"]


def decode(llm: LLM, prompts: list[str], method: str, setting: str, args) -> tuple[int, float, Counter]:
    """One generate() call over the prompts -> (tokens, seconds, k histogram of the speculative steps)."""
    k = 0 if setting == "plain" else None if setting == "auto" else int(setting.removeprefix("k="))
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                             seed=args.seed + i if args.temperature > 0 else None, speculative_method=method,
                             num_speculative_tokens=k) for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    chosen: Counter = Counter()
    for o in outs:
        if o.speculation is not None:
            chosen.update(o.speculation.steps_by_k)
    return sum(len(o.output_token_ids) for o in outs), seconds, chosen


def summarise(runs: list[dict[str, tuple[int, float, Counter]]], settings: list[str]) -> dict:
    """runs: per round, setting -> (tokens, seconds, k histogram). Pure."""
    rate = {s: [r[s][0] / r[s][1] for r in runs] for s in settings}
    fixed = [s for s in settings if s.startswith("k=")]
    best = max(fixed, key=lambda s: statistics.median(rate[s])) if fixed else None
    chosen: Counter = Counter()
    for r in runs:
        chosen.update(r["auto"][2])
    out = {"tokens_per_s": {s: round(statistics.median(v), 2) for s, v in rate.items()},
           "best_fixed": best,
           "auto_over_plain": round(statistics.median(a / p for a, p in zip(rate["auto"], rate["plain"])), 3),
           "auto_chosen_k": {str(k): n for k, n in sorted(chosen.items())}}
    if best is not None:
        out["auto_over_best_fixed"] = round(statistics.median(a / b for a, b in zip(rate["auto"], rate[best])), 3)
    return out


def table(report: dict) -> str:
    lines = ["| method | streams | plain tok/s | best fixed | auto / best fixed | auto / plain | auto's k (steps) |",
             "|---|---|---|---|---|---|---|"]
    for row in report["results"]:
        s = row["summary"]
        lines.append(f"| {row['method']} | {row['concurrency']} | {s['tokens_per_s']['plain']} | {s['best_fixed']} "
                     f"({s['tokens_per_s'].get(s['best_fixed'], '-')} tok/s) | {s.get('auto_over_best_fixed', '-')}× "
                     f"| {s['auto_over_plain']}× | {s['auto_chosen_k']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = [{"method": m, "num_speculative_tokens": "auto", "max_speculative_tokens": args.max_k}
              for m in args.methods]
    llm = LLM(model=args.model, speculative_config=json.dumps(config), dtype=args.dtype,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.concurrency), seed=args.seed)
    proposers = llm.engine.proposers
    questions = heldout_prompts()

    def chat(text: str) -> str:
        return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
    llm.generate(chat(questions[0]), SamplingParams(max_tokens=8))  # warm-up
    rng = random.Random(args.seed)
    tree_ks = [int(k) for k in args.tree_ks.split(",")]
    chain_ks = [int(k) for k in args.chain_ks.split(",")]
    results = []
    for c in args.concurrency:
        prompts = [chat(questions[i % len(questions)]) for i in range(c)]
        for method in proposers:
            p = proposers[method]
            settings = settings_for(p.num_speculative_tokens, p.needs.tree, chain_ks, tree_ks)
            runs = []
            for _ in range(args.rounds):
                order = list(settings)
                rng.shuffle(order)
                runs.append({s: decode(llm, prompts, method, s, args) for s in order})
            results.append({"method": method, "concurrency": c, "settings": settings,
                            "summary": summarise(runs, settings),
                            "rounds": [{s: [t, round(sec, 4)] for s, (t, sec, _) in r.items()} for r in runs]})
            print(f"[bench] {method} at {c} streams done", file=sys.stderr)
    report = {"benchmark": "adaptive", "machine": machine_info(llm.engine.device), "args": vars(args),
              "speculative_config": config, "results": results}
    emit(report, args.out, table(report))
    return report


if __name__ == "__main__":
    main()
