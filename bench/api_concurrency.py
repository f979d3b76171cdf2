"""Speculation through the API under concurrency: one `specserve serve` on 127.0.0.1, rounds of C concurrent
streamed chat completions over held-out chat prompts, each round run once per k (request field
`num_speculative_tokens`; 0 = plain) back to back, so plain and speculative share the server, the weights and the
machine's state. Speedup = median over rounds of (tokens/s at k) / (tokens/s at 0 in the same round).

`python -m bench.api_concurrency --concurrency 1,4,16 --ks 2,4,auto --max-tokens 64 --rounds 3
 [--model M --draft-model D] [--temperature 0] [--extra-args "--max-num-seqs 16"] [--out results.json]`

Prints JSON (stdout or --out) and a markdown table (stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time

import httpx

from bench.output import emit
from bench.prompts import heldout_prompts
from bench.soak import ServerProcess, wait_healthy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.api_concurrency", description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrent streams")
    ap.add_argument("--ks", default="2,4", help="comma-separated num_speculative_tokens (0 always runs), each "
                    "optionally METHOD:K to ask for one of the server's methods (e.g. medusa:auto,draft:4); `auto` "
                    "sends no k, so the server's default (auto unless --extra-args says otherwise) applies")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", help="target (default: the demo target)")
    ap.add_argument("--draft-model", help="draft (default: the demo draft when --model is unset)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--extra-args", default="", help="more `specserve serve` flags, one shell-quoted string")
    ap.add_argument("--out", help="write the JSON here instead of stdout")
    args = ap.parse_args(argv)
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x.strip()]
    picks = [x.strip() for x in args.ks.split(",") if x.strip() and x.strip() != "0"]
    args.ks = list(dict.fromkeys(int(x) if x.isdigit() else x for x in picks))  # in the order given
    args.shutdown_wait = 60
    return args


def method_and_k(label) -> tuple[str | None, int | str]:
    """2 -> (None, 2): the server's default method; "medusa:auto" -> ("medusa", "auto")."""
    if isinstance(label, int):
        return None, label
    method, _, k = label.rpartition(":")
    return method or None, int(k) if k.isdigit() else k


async def one_stream(client: httpx.AsyncClient, model: str, prompt: str, k: int, args, seed: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    method, k = method_and_k(k)
    if method:
        body["speculative_method"] = method
    if k != "auto":
        body["num_speculative_tokens"] = k
    usage = spec = None
    async with client.stream("POST", "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                if event.get("usage"):
                    usage, spec = event["usage"], event.get("speculation")
    return {"tokens": usage["completion_tokens"], "draft": spec["num_draft_tokens"],
            "accepted": spec["num_accepted_tokens"], "steps": spec["num_steps"]}


async def one_round(client, model: str, prompts: list[str], c: int, k: int, args, offset: int) -> dict:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_stream(client, model, prompts[(offset + i) % len(prompts)], k, args,
                                                seed=offset + i) for i in range(c)))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    draft = sum(r["draft"] for r in results)
    accepted = sum(r["accepted"] for r in results)
    steps = sum(r["steps"] for r in results)
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens, "draft": draft, "accepted": accepted,
            "steps": steps}


async def run(args, server: ServerProcess) -> dict:
    prompts = heldout_prompts()
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers()) as client:
        why = await wait_healthy(server, client, 600)
        if why:
            raise SystemExit(f"server not healthy: {why}\n{server.log_tail()}")
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await one_round(client, model, prompts, 2, args.ks[0] if args.ks else 0, args, 0)  # warm-up
        rows = []
        for c in args.concurrency:
            per_k: dict[int, list[dict]] = {k: [] for k in [0, *args.ks]}
            for r in range(args.rounds):
                for k in per_k:  # same prompts for every k within a round
                    per_k[k].append(await one_round(client, model, prompts, c, k, args, offset=r * c))
            for k, runs in per_k.items():
                ratios = [x["tokens_per_s"] / base["tokens_per_s"] for x, base in zip(runs, per_k[0])]
                draft, acc = sum(x["draft"] for x in runs), sum(x["accepted"] for x in runs)
                steps = sum(x["steps"] for x in runs)
                rows.append({"concurrency": c, "k": k,
                             "tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs),
                             "speedup": statistics.median(ratios), "speedup_min": min(ratios),
                             "speedup_max": max(ratios),
                             "acceptance_rate": acc / draft if draft else None,
                             "mean_accepted_length": 1 + acc / steps if draft and steps else None})
                print(f"[api] c={c} k={k} {rows[-1]['tokens_per_s']:.1f} tok/s speedup {rows[-1]['speedup']:.2f}",
                      file=sys.stderr, flush=True)
    return {"model": model, "rows": rows, "args": {k: v for k, v in vars(args).items() if k != "shutdown_wait"},
            "machine": {"platform": platform.platform(), "processor": platform.processor(),
                        "cpus": __import__("os").cpu_count()}}


def table(report: dict) -> str:
    lines = ["| streams | k | tokens/s | speedup (min–max) | acceptance rate | mean accepted length |",
             "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        acc = "–" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        tau = "–" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        lines.append(f"| {r['concurrency']} | {r['k'] if r['k'] else '0 (plain)'} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}× ({r['speedup_min']:.2f}–{r['speedup_max']:.2f}) | {acc} | {tau} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = ServerProcess(args)
    try:
        report = asyncio.run(run(args, server))
    finally:
        server.terminate()
        server.kill()
    emit(report, args.out, table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
