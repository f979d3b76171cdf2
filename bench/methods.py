"""Every speculation method on one engine and two workloads: open-ended chat, and input-grounded work (edit a given
code file, summarise a given passage). Methods run interleaved per repeat on the same loaded weights; speedup is
the within-repeat ratio to plain decoding. Prints JSON (stdout or --out) and a markdown table (stderr).

`python -m bench.methods --max-tokens 96 --repeats 2 --out methods.json`
`python -m bench.methods --medusa --concurrency 1,4,16` (Medusa heads too; c prompts per generate() call)
`python -m bench.methods --medusa --dflash --workloads chat --concurrency 1,4,8,16` (and the DFlash drafter)
`python -m bench.methods --medusa --dflash --eagle3 --k auto` (and the EAGLE-3 drafter)
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import sys
import time

import torch

from bench.output import emit
from bench.spec_decode import _fmt, first_diff, machine_info, speculation_counts
from specserve.config.schema import parse_k
from specserve.engine import LLM, SamplingParams

CODE_FUNCTIONS = ("textwrap.indent", "fnmatch.filter", "shlex.join", "heapq.nsmallest")
PASSAGE_MODULES = ("heapq", "difflib", "bisect")


def _source(dotted: str) -> str:
    module, name = dotted.rsplit(".", 1)
    return inspect.getsource(getattr(__import__(module), name))


def grounded_tasks(num: int) -> list[tuple[str, str]]:
    """(user message, prediction) pairs built from this interpreter's standard library: the prediction is the
    given text itself (an edit keeps most of it), as OpenAI suggests for Predicted Outputs."""
    code_tasks, passage_tasks = [], []
    for dotted in CODE_FUNCTIONS:
        code = _source(dotted).strip()
        code_tasks.append((f"Here is a Python function:\n\n```python\n{code}\n```\n\nAdd a one-line comment above "
                           "the `return` statement and reply with the whole function, unchanged otherwise.", code))
    for name in PASSAGE_MODULES:
        passage = " ".join((__import__(name).__doc__ or "").split())[:900]
        passage_tasks.append((f"Summarise the following passage in three sentences, reusing its wording:\n\n"
                              f"{passage}", passage))
    mixed = [t for pair in zip(code_tasks, passage_tasks) for t in pair] + code_tasks[len(passage_tasks):]
    return mixed[:num]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.methods", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (default: the demo target, SmolLM2-135M-Instruct)")
    ap.add_argument("--draft-model", default=None, help="draft for the draft method (default: the bundled one)")
    ap.add_argument("--k", type=parse_k, default=4,
                    help="num_speculative_tokens of the draft and ngram methods: an integer, or auto (adaptive, up "
                         "to --max-k)")
    ap.add_argument("--max-k", type=int, default=4, help="max_speculative_tokens when --k auto")
    ap.add_argument("--fixed-k", type=int, default=None,
                    help="with --k auto, also run each method with this fixed k per request (rows 'METHOD@k=N')")
    ap.add_argument("--ngram-branches", type=int, default=1, help="prompt_lookup_branches (> 1: n-gram trees)")
    ap.add_argument("--prediction-k", type=int, default=8, help="num_speculative_tokens of Predicted Outputs")
    ap.add_argument("--medusa", action="store_true",
                    help="also load Medusa heads (--medusa-heads, else the target's or the demo target's bundled)")
    ap.add_argument("--medusa-heads", default=None, help="a Medusa heads directory (implies --medusa)")
    ap.add_argument("--medusa-k", type=parse_k, default="auto",
                    help="num_speculative_tokens (tree nodes) of medusa: an integer, or auto (within the whole tree)")
    ap.add_argument("--dflash", action="store_true",
                    help="also load a DFlash drafter (--dflash-model, else the demo target's bundled one)")
    ap.add_argument("--dflash-model", default=None, help="a DFlash drafter directory (implies --dflash)")
    ap.add_argument("--dflash-k", type=parse_k, default="auto",
                    help="num_speculative_tokens of dflash: an integer <= block size - 1, or auto (within the block)")
    ap.add_argument("--eagle3", action="store_true",
                    help="also load an EAGLE-3 drafter (--eagle3-model, else the demo target's bundled one)")
    ap.add_argument("--eagle3-model", default=None, help="an EAGLE-3 drafter directory (implies --eagle3)")
    ap.add_argument("--eagle3-topk", type=int, default=1,
                    help="speculative_eagle_topk: 1 drafts chains, > 1 dynamic trees (then --eagle3-max-k is the "
                         "node budget)")
    ap.add_argument("--eagle3-max-k", type=int, default=None,
                    help="EAGLE-3's max_speculative_tokens (default --max-k; a tree's node budget under auto)")
    ap.add_argument("--eagle3-k", type=parse_k, default=None, help="EAGLE-3's k (default --k)")
    ap.add_argument("--only", default="",
                    help="comma-separated methods to load (default: draft, ngram and whichever of --medusa, "
                         "--dflash, --eagle3 are set)")
    ap.add_argument("--concurrency", default="1",
                    help="comma-separated levels: at level c the prompts (cycled to a multiple of c) go c per "
                         "generate() call and decode together")
    ap.add_argument("--workloads", default="chat,grounded", help="comma-separated: chat, grounded")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-prompts", type=int, default=4, help="prompts per workload")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="auto = the engine's choice (bf16 where native, else fp32 on CPU)")
    ap.add_argument("--quantization", default="none",
                    help="none (default: the dtype's weights, as docs/ measured) | auto (the server's default) | int8 | int4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.medusa = args.medusa or args.medusa_heads is not None
    args.dflash = args.dflash or args.dflash_model is not None
    args.eagle3 = args.eagle3 or args.eagle3_model is not None
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    args.workloads = [w.strip() for w in str(args.workloads).split(",") if w.strip()]
    if not args.workloads or set(args.workloads) - {"chat", "grounded"}:
        ap.error("--workloads: chat and/or grounded, comma-separated")
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error("--concurrency: positive integers, comma-separated")
    return args


def methods_for(workload: str, loaded: list[str], fixed_k: int | None = None) -> list[str]:
    """loaded: the speculation methods the LLM has, in the order to run them."""
    out = ["none"] + loaded + ([f"{m}@k={fixed_k}" for m in loaded] if fixed_k else [])
    return out + (["prediction"] if workload == "grounded" else [])


def at_level(items: list, concurrency: int) -> list:
    """The workload cycled to a whole number of generate() calls of `concurrency` prompts (itself at level 1)."""
    return [items[i % len(items)] for i in range(concurrency * math.ceil(len(items) / concurrency))]


def run_method(llm: LLM, prompts: list[str], predictions: list[str | None], method: str, args,
               concurrency: int = 1) -> tuple[list, float]:
    """Every prompt once, `concurrency` per generate() call; -> (outputs in prompt order, wall seconds)."""
    outs, wall = [], 0.0
    name, _, fixed = method.partition("@k=")
    for start in range(0, len(prompts), concurrency):
        params = []
        for i in range(start, min(start + concurrency, len(prompts))):
            extra = dict(prediction=predictions[i], speculative_method="none",
                         num_speculative_tokens=args.prediction_k) if method == "prediction" else \
                dict(speculative_method=name, num_speculative_tokens=int(fixed) if fixed else None)
            params.append(SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                         seed=args.seed + i if args.temperature > 0 else None, **extra))
        t0 = time.perf_counter()
        outs += llm.generate(prompts[start: start + concurrency], params)
        wall += time.perf_counter() - t0
    return outs, wall


def summarise(runs: list[dict], methods: list[str], greedy: bool, concurrency: int = 1) -> list[dict]:
    """runs[rep][method] = (outputs, wall seconds), all at one concurrency level."""
    rows = []
    plain = [sum(len(o.output_token_ids) for o in r["none"][0]) / r["none"][1] for r in runs]
    for m in methods:
        tps = [sum(len(o.output_token_ids) for o in r[m][0]) / r[m][1] for r in runs]
        outs = [o for r in runs for o in r[m][0]]
        row = {"method": m, "concurrency": concurrency, "tokens_per_s": round(statistics.median(tps), 3),
               "tokens_per_s_per_repeat": [round(t, 3) for t in tps],
               "speedup": round(statistics.median([t / p for t, p in zip(tps, plain)]), 4),
               "speedup_per_repeat": [round(t / p, 4) for t, p in zip(tps, plain)],
               **speculation_counts(outs), "generated_tokens": sum(len(o.output_token_ids) for o in outs)}
        if m == "prediction":
            row["accepted_prediction_tokens"] = sum(o.speculation.accepted_prediction_tokens or 0 for o in outs)
            row["rejected_prediction_tokens"] = sum(o.speculation.rejected_prediction_tokens or 0 for o in outs)
        if greedy:
            diffs = [first_diff(o.output_token_ids, p.output_token_ids) for r in runs
                     for o, p in zip(r[m][0], r["none"][0])]
            row["greedy_identical"] = all(d is None for d in diffs)
            row["greedy_first_diffs"] = [d for d in diffs if d is not None]
        rows.append(row)
    return rows


def table(report: dict) -> str:
    a = report["args"]
    medusa = f", medusa k = {a['medusa_k']}" if a.get("medusa") else ""
    medusa += f", dflash k = {a['dflash_k']}" if a.get("dflash") else ""
    lines = [f"machine: {report['machine']['cpu']} | threads {report['machine']['torch_threads']} | {a['dtype']} | "
             f"{a['num_prompts']} prompts per workload x {a['max_tokens']} tokens x {a['repeats']} repeats "
             f"| T = {a['temperature']} | k = {a['k']} (prediction {a['prediction_k']}){medusa}, ngram branches "
             f"{a['ngram_branches']}", "",
             "| workload | streams | method | tokens/s | speedup | acceptance α | τ | greedy identical |",
             "|---|---|---|---|---|---|---|---|"]
    for workload, rows in report["workloads"].items():
        for r in rows:
            sp = r["speedup_per_repeat"]
            spread = f" ({min(sp):.2f}–{max(sp):.2f})" if len(sp) > 1 and r["method"] != "none" else ""
            lines.append(f"| {workload} | {r.get('concurrency', 1)} | {r['method']} | {r['tokens_per_s']:.1f} | "
                         f"{r['speedup']:.2f}x{spread} | "
                         f"{_fmt(r['acceptance_rate'])} | {_fmt(r['mean_accepted_length'], '.2f')} | "
                         f"{_fmt(r.get('greedy_identical'), '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = [{"method": "draft", "num_speculative_tokens": args.k}] if args.model is None or args.draft_model else []
    if config and args.draft_model:
        config[0]["model"] = args.draft_model
    config.append({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_branches": args.ngram_branches})
    if args.medusa:  # its auto ranges over the whole tree, whatever --max-k says for the chains
        config.append({"method": "medusa", "num_speculative_tokens": args.medusa_k}
                      | ({"medusa_heads": args.medusa_heads} if args.medusa_heads else {}))
    if args.dflash:  # like medusa's, its auto ranges over the whole block
        config.append({"method": "dflash", "num_speculative_tokens": args.dflash_k}
                      | ({"model": args.dflash_model} if args.dflash_model else {}))
    if args.eagle3:  # chains by default, like the draft model's: the same k
        config.append({"method": "eagle3", "num_speculative_tokens": args.eagle3_k or args.k,
                       "speculative_eagle_topk": args.eagle3_topk,
                       "max_speculative_tokens": args.eagle3_max_k or args.max_k}
                      | ({"model": args.eagle3_model} if args.eagle3_model else {}))
    if args.only:
        config = [c for c in config if c["method"] in args.only.split(",")]
    llm = LLM(model=args.model, speculative_config=json.dumps(config), dtype=args.dtype, device=args.device,
              quantization=args.quantization,
              kv_cache_memory=512 << 20, max_num_seqs=max(4, *args.concurrency), seed=args.seed,
              max_speculative_tokens=args.max_k)
    args.dtype = str(llm.engine.dtype).removeprefix("torch.")  # what `auto` resolved to, for the report

    def chat(text: str) -> str:
        return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
    from bench.prompts import heldout_prompts
    questions = heldout_prompts()[: args.num_prompts]
    tasks = grounded_tasks(args.num_prompts)
    workloads = {"chat": ([chat(q) for q in questions], [None] * len(questions)),
                 "grounded": ([chat(t) for t, _ in tasks], [p for _, p in tasks])}
    workloads = {w: workloads[w] for w in args.workloads}
    loaded = [m for m in ("draft", "ngram", "medusa", "dflash", "eagle3") if m in llm.engine.proposers]
    info = machine_info(llm.engine.device)
    info["loadavg_start"] = list(os.getloadavg())
    llm.generate(next(iter(workloads.values()))[0][0], SamplingParams(max_tokens=8))  # warm-up
    runs: dict[tuple[str, int], list[dict]] = {(w, c): [] for w in workloads for c in args.concurrency}
    for rep in range(args.repeats):
        for c in args.concurrency:
            for w, (prompts, preds) in workloads.items():
                runs[w, c].append({m: run_method(llm, at_level(prompts, c), at_level(preds, c), m, args, c)
                                   for m in methods_for(w, loaded, args.fixed_k)})
        print(f"[bench] repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    info["loadavg_end"] = list(os.getloadavg())
    report = {"benchmark": "methods", "machine": info, "args": vars(args), "speculative_config": config,
              "prompts": {"chat": questions, "grounded": [t for t, _ in tasks]},
              "workloads": {w: [row for c in args.concurrency
                                for row in summarise(runs[w, c], methods_for(w, loaded, args.fixed_k),
                                                     args.temperature == 0, c)]
                            for w in workloads}}
    emit(report, args.out, table(report))
    return report


if __name__ == "__main__":
    main()
