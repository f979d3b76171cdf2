"""Adaptive k against every fixed k, in one run: for each workload, concurrency and loaded method, rounds in which
plain decoding, each fixed k (chains: 1..4; tree methods: node budgets) and `auto` each decode the same prompts (c
per generate() call, at least --prompts of them), in a seeded shuffled order per round so that no setting always
runs first or last. Reports per row the median tokens/s of each setting, auto / best fixed and auto / plain (medians
of the per-round ratios), the histogram of the k auto chose, how well the adaptive controller's step cost model
predicted the steps it saw (measured / predicted seconds, one step ahead; per kind of step: plain, chain, tree), and
how many of auto's drafts were accepted against how many its acceptance estimates expected.

`python -m bench.adaptive --eagle3 --medusa --dflash --concurrency 1,4,16,32 --rounds 2 --out docs/adaptive.json`

Greedy, stopping at EOS like a real chat (no ignore_eos: past EOS a model's text is not what proposers meet in
service). Prints JSON (stdout or --out) and a markdown table (stderr).
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

from bench.methods import grounded_tasks
from bench.output import emit
from bench.prompts import heldout_prompts
from bench.spec_decode import machine_info
from specserve.engine import LLM, SamplingParams
from specserve.engine.spec_decode.costs import PredictionLog


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
    ap.add_argument("--workloads", default="chat,grounded", help="comma-separated: chat, grounded")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per setting at least (c per generate() call)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none",
                    help="none (default: the dtype's weights, as docs/ measured) | auto (the server's default) | int8 | int4")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m.strip()]
    args.methods += [m for m in ("medusa", "dflash", "eagle3") if getattr(args, m) and m not in args.methods]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.workloads = [w for w in args.workloads.split(",") if w.strip()]
    if not args.workloads or set(args.workloads) - {"chat", "grounded"}:
        ap.error("--workloads: chat and/or grounded, comma-separated")
    return args


def settings_for(k_max: int, tree: bool, chain_ks: list[int], tree_ks: list[int]) -> list[str]:
    """"plain", "k=N" for each fixed k within the method's reach, "auto". Pure."""
    ks = sorted({min(k, k_max) for k in (tree_ks if tree else chain_ks)})
    return ["plain", *[f"k={k}" for k in ks], "auto"]


def batches(prompts: list[str], concurrency: int, at_least: int) -> list[list[str]]:
    """The workload cycled to max(c, at_least) prompts rounded up to whole generate() calls of c. Pure."""
    n = concurrency * -(-max(concurrency, at_least) // concurrency)
    cycled = [prompts[i % len(prompts)] for i in range(n)]
    return [cycled[i: i + concurrency] for i in range(0, n, concurrency)]


def decode(llm: LLM, calls: list[list[str]], method: str, setting: str, args) -> tuple[int, float, Counter]:
    """The calls' generate()s -> (tokens, seconds, k histogram of the decode steps)."""
    k = 0 if setting == "plain" else None if setting == "auto" else int(setting.removeprefix("k="))
    tokens, seconds, chosen = 0, 0.0, Counter()
    for prompts in calls:
        params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                 seed=args.seed + i if args.temperature > 0 else None, speculative_method=method,
                                 num_speculative_tokens=k) for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds += time.perf_counter() - t0
        for o in outs:
            tokens += len(o.output_token_ids)
            if o.speculation is not None:
                chosen.update(o.speculation.steps_by_k)
    return tokens, seconds, chosen


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
    header = ("| workload | method | streams | plain tok/s | best fixed | auto / best fixed | auto / plain | "
              "auto's k (steps) | step cost measured / predicted (median, median abs error) |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for row in report["results"]:
        s, p = row["summary"], row.get("step_prediction", {})
        fit = f"{p['median_measured_over_predicted']} ({p['median_abs_error']:.0%})" if p.get("steps") else "-"
        lines.append(f"| {row.get('workload', 'chat')} | {row['method']} | {row['concurrency']} | "
                     f"{s['tokens_per_s']['plain']} | {s['best_fixed']} "
                     f"({s['tokens_per_s'].get(s['best_fixed'], '-')} tok/s) | {s.get('auto_over_best_fixed', '-')}× "
                     f"| {s['auto_over_plain']}× | {s['auto_chosen_k']} | {fit} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = [{"method": m, "num_speculative_tokens": "auto"}  # Medusa's and DFlash's auto: their whole tree/block
              | ({} if m in ("medusa", "dflash") else {"max_speculative_tokens": args.max_k}) for m in args.methods]
    llm = LLM(model=args.model, speculative_config=json.dumps(config), dtype=args.dtype, quantization=args.quantization,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.concurrency), seed=args.seed)
    proposers = llm.engine.proposers
    controller = llm.engine.controller

    def chat(text: str) -> str:
        return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
    workloads = {"chat": [chat(q) for q in heldout_prompts()],
                 "grounded": [chat(t) for t, _ in grounded_tasks(len(heldout_prompts()))]}
    llm.generate(workloads["chat"][0], SamplingParams(max_tokens=8))  # warm-up
    rng = random.Random(args.seed)
    tree_ks = [int(k) for k in args.tree_ks.split(",")]
    chain_ks = [int(k) for k in args.chain_ks.split(",")]
    results = []
    for workload in args.workloads:
        for c in args.concurrency:
            calls = batches(workloads[workload], c, args.prompts)
            for method in proposers:
                p = proposers[method]
                settings = settings_for(p.num_speculative_tokens, p.needs.tree, chain_ks, tree_ks)
                runs = []
                controller.costs.log = PredictionLog()  # this row's steps only
                controller.accepted_log = {}
                for _ in range(args.rounds):
                    order = list(settings)
                    rng.shuffle(order)
                    runs.append({s: decode(llm, calls, method, s, args) for s in order})
                results.append({"workload": workload, "method": method, "concurrency": c, "settings": settings,
                                "summary": summarise(runs, settings),
                                "step_prediction": controller.costs.log.summary(),
                                "accepted_prediction": controller.report()["accepted_prediction"].get(method),
                                "fitted_costs": {k: v for k, v in controller.report().items()
                                                 if k not in ("step_prediction", "accepted_prediction")},
                                "rounds": [{s: [t, round(sec, 4)] for s, (t, sec, _) in r.items()} for r in runs]})
                print(f"[bench] {workload} {method} at {c} streams done", file=sys.stderr)
    report = {"benchmark": "adaptive", "machine": machine_info(llm.engine.device), "args": vars(args),
              "speculative_config": config, "results": results}
    emit(report, args.out, table(report))
    return report


if __name__ == "__main__":
    main()
