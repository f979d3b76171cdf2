"""Automatic prefix caching on vs off, in the same run: time to first token (p50/p99), throughput and hit rate.

Workloads (chat-templated on the demo target):
  shared     one long system prompt (--prefix-tokens) and many questions, c questions per wave;
  multiturn  c conversations of --turns turns that resend the whole conversation each turn;
  distinct   prompts with no shared prefix (raw text, each opening differently): caching can only cost here.
Two engines are loaded with the same weights and settings but for `enable_prefix_caching`; every repeat runs every
workload and level on both, in alternating order, and every (workload, level, repeat) uses its own cache salt, so
each run starts cold. The first request of a shared-prefix run is cold by construction; "repeat TTFT" is over the
others.

    python -m bench.prefix_cache --concurrency 1,8 --repeats 3 --out prefix.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.output import emit
from bench.prompts import heldout_prompts
from bench.spec_decode import machine_info
from specserve.engine import LLM, SamplingParams
from specserve.train.prompts import TOPICS  # distinct prompts built from the training topics

QUESTIONS = ["Which topic in the notes is about space?", "Name two topics about music.", "What is listed about food?",
             "Which notes talk about the body?", "Pick one topic about computers and explain it.",
             "Is there anything about weather?", "Which topics are about animals?", "Summarise the notes in a line.",
             "What is the first topic?", "Which topics involve money?", "Name a topic about history.",
             "Which topic would a gardener like?", "What is said about sport?", "Find a topic about chemistry.",
             "Which topics are about travel?", "Name a topic about writing."]
FOLLOW_UPS = ["Tell me more.", "Give an example.", "Why does that matter?", "Summarise what you said.",
              "What else should I know?"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the demo target, SmolLM2-135M-Instruct)")
    ap.add_argument("--speculative-method", default=None, help="as the server's flag (default: the server's)")
    ap.add_argument("--workloads", default="shared,multiturn,distinct")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated levels (requests per wave)")
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="system prompt length of the shared workload")
    ap.add_argument("--num-questions", type=int, default=16, help="questions per shared-prefix run")
    ap.add_argument("--turns", type=int, default=4, help="turns per multi-turn conversation")
    ap.add_argument("--num-distinct", type=int, default=0,
                    help="prompts per distinct-prefix run (at least c; 0: two waves, at least 8)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none",
                    help="none (default: the dtype's weights, as docs/ measured) | auto (the server's default) | int8 | int4")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes per engine")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def notes(tokenizer, num_tokens: int) -> str:
    """A deterministic document of about num_tokens tokens (numbered notes over the self-instruct topics)."""
    lines, i = [], 0
    while True:
        topic = TOPICS[i % len(TOPICS)].strip()
        lines.append(f"Note {i + 1}: {topic} — a topic the reader asked about; keep answers about it short.")
        i += 1
        if i % 8 == 0 and len(tokenizer.encode("\n".join(lines))) >= num_tokens:
            return "\n".join(lines)


def chat(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def waves(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def timed(llm: LLM, prompts: list[str], params: SamplingParams, record: dict) -> list:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    record["seconds"] += time.perf_counter() - t0
    for o in outs:
        record["ttft"].append(o.first_token_time - o.arrival_time)
        record["prompt_tokens"] += len(o.prompt_token_ids)
        record["cached_tokens"] += o.num_cached_tokens
        record["output_tokens"] += len(o.output_token_ids)
    return outs


def run_workload(llm: LLM, workload: str, level: int, salt: str, doc: str, args) -> dict:
    tok = llm.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, cache_salt=salt)
    rec = {"seconds": 0.0, "ttft": [], "prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0}
    if workload == "shared":
        system = {"role": "system", "content": "Answer from these notes.\n" + doc}
        prompts = [chat(tok, [system, {"role": "user", "content": q}])
                   for q in (QUESTIONS * 8)[:args.num_questions]]
        for wave in waves(prompts, level):
            timed(llm, wave, params, rec)
    elif workload == "multiturn":
        convs = [[{"role": "user", "content": q}] for q in heldout_prompts()[:level]]
        for turn in range(args.turns):
            outs = timed(llm, [chat(tok, c) for c in convs], params, rec)
            for c, o in zip(convs, outs):
                c += [{"role": "assistant", "content": o.text},
                      {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    elif workload == "distinct":
        count = max(level, args.num_distinct) if args.num_distinct else max(level, 4) * 2
        prompts = [f"[{salt}/{i}] " + p for i, p in enumerate((heldout_prompts() * (count // 8 + 1))[:count])]
        for wave in waves(prompts, level):
            timed(llm, wave, params, rec)
    else:
        raise SystemExit(f"unknown workload {workload!r}")
    return rec


def summarise(recs: list[dict], workload: str) -> dict:
    ttft = sorted(t for r in recs for t in r["ttft"])
    per_run = [r["ttft"] for r in recs]
    out = {"ttft_p50_s": statistics.median(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
           "tokens_per_s": sum(r["output_tokens"] for r in recs) / sum(r["seconds"] for r in recs),
           "tokens_per_s_per_repeat": [r["output_tokens"] / r["seconds"] for r in recs],
           "hit_rate": sum(r["cached_tokens"] for r in recs) / max(1, sum(r["prompt_tokens"] for r in recs)),
           "prompt_tokens": sum(r["prompt_tokens"] for r in recs)}
    if workload == "shared":  # the cold first request of each run vs the rest
        out["first_ttft_s"] = statistics.median(t[0] for t in per_run)
        rest = sorted(x for t in per_run for x in t[1:])
        out["repeat_ttft_p50_s"] = statistics.median(rest) if rest else None
    return out


def table(report: dict) -> str:
    lines = [f"machine: {report['machine']['cpu']} | threads {report['machine']['torch_threads']} | "
             f"{report['dtype']} | method {report['method']} | {report['args']['repeats']} repeats", "",
             "| workload | streams | caching | TTFT p50 | TTFT p99 | first TTFT | repeat TTFT p50 | tok/s | "
             "speedup (on/off) | hit rate |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        def ms(key):
            v = row.get(key)
            return "–" if v is None else f"{v * 1000:.0f} ms"
        speed = row.get("speedup")
        spread = row.get("speedup_per_repeat") or []
        sp = "–" if speed is None else f"{speed:.2f}× ({min(spread):.2f}–{max(spread):.2f})"
        lines.append(f"| {row['workload']} | {row['concurrency']} | {'on' if row['caching'] else 'off'} | "
                     f"{ms('ttft_p50_s')} | {ms('ttft_p99_s')} | {ms('first_ttft_s')} | {ms('repeat_ttft_p50_s')} | "
                     f"{row['tokens_per_s']:.1f} | {sp} | {row['hit_rate']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kw = dict(model=args.model, speculative_method=args.speculative_method, dtype=args.dtype, device=args.device,
              quantization=args.quantization, kv_cache_memory=args.kv_cache_memory, seed=0)
    engines = {False: LLM(enable_prefix_caching=False, **kw), True: LLM(enable_prefix_caching=True, **kw)}
    doc = notes(engines[True].tokenizer, args.prefix_tokens)
    levels = [int(c) for c in args.concurrency.split(",")]
    workloads = args.workloads.split(",")
    for llm in engines.values():  # warm-up: kernels, allocator, adaptive-k costs
        llm.generate(["Hello there, how are you?"] * 2, SamplingParams(temperature=0.0, max_tokens=8))
    recs: dict[tuple, list[dict]] = {}
    for r in range(args.repeats):
        for w in workloads:
            for c in levels:
                order = (False, True) if (r + c) % 2 == 0 else (True, False)
                for caching in order:
                    rec = run_workload(engines[caching], w, c, f"{w}-{c}-repeat-{r}", doc, args)
                    recs.setdefault((w, c, caching), []).append(rec)
                    print(f"[bench] repeat {r + 1}/{args.repeats} {w} c={c} caching={caching}: "
                          f"{rec['seconds']:.1f} s", file=sys.stderr)
    rows = []
    for (w, c, caching), rs in recs.items():
        row = {"workload": w, "concurrency": c, "caching": caching} | summarise(rs, w)
        if caching:
            off = recs[(w, c, False)]
            ratios = [(on["output_tokens"] / on["seconds"]) / (o["output_tokens"] / o["seconds"])
                      for on, o in zip(rs, off)]
            row["speedup"] = statistics.median(ratios)
            row["speedup_per_repeat"] = ratios
        rows.append(row)
    rows.sort(key=lambda x: (workloads.index(x["workload"]), x["concurrency"], x["caching"]))
    core = engines[True].engine
    report = {"benchmark": "prefix_cache", "machine": machine_info(core.device), "dtype": str(core.dtype),
              "method": core.default_method, "args": vars(args),
              "prefix_tokens": len(engines[True].tokenizer.encode(doc)), "rows": rows}
    emit(report, args.out, table(report))
    return report


if __name__ == "__main__":
    main()
