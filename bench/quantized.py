"""The demo target in its dtype against its weight-only quantizations, offline, in one process: an engine per
quantization (all loaded at once), each decoding the same held-out chat prompts plainly and with the demo default
method (EAGLE-3, auto k), at each concurrency, in a shuffled order per round. Reports tokens/s and the ratio to the
unquantized plain engine in the same round (median over rounds), and each engine's resident weight bytes.

`python -m bench.quantized --quantizations none,int8,int4 --concurrency 1,4,16 --rounds 2 --out docs/quantized.json`

Prints JSON (stdout or --out) and a markdown table (stderr). Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

import torch

from bench.adaptive import batches, decode
from bench.output import emit
from bench.prompts import heldout_prompts
from bench.spec_decode import machine_info
from specserve.engine import LLM, SamplingParams


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (packed codes and scales included)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.quantized", description=__doc__.splitlines()[0])
    ap.add_argument("--quantizations", default="none,int8,int4",
                    help="none | int8 | int4 | auto, each optionally :N for --quantization-dense-rows N (e.g. int4:16) "
                         "and @DTYPE for its own dtype (e.g. int4@float32,int4@bfloat16)")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU computes it natively, else fp32")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per setting at least (c per generate() call)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    quants = [q.strip() for q in args.quantizations.split(",") if q.strip()]
    levels = [int(c) for c in args.concurrency.split(",")]
    engines = {}
    for q in quants:  # "int4:16@float32": int4, dense copies from 16 rows, fp32 activations
        name, _, dtype = q.partition("@")
        engines[q] = LLM(quantization=None if name.startswith("none") else name.partition(":")[0],
                         quantization_dense_rows=int(name.partition(":")[2] or 0), max_num_seqs=max(levels),
                         seed=args.seed, kv_cache_memory=512 << 20, dtype=dtype or args.dtype)
    first = engines[quants[0]]
    method = first.engine.default_method

    def chat(text: str) -> str:
        return first.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=False)
    prompts = [chat(q) for q in heldout_prompts()]
    for llm in engines.values():
        llm.generate(prompts[0], SamplingParams(max_tokens=8))  # warm-up
    settings = [(q, m) for q in quants for m in ("none", method)]
    rng = random.Random(args.seed)
    results = []
    for c in levels:
        calls = batches(prompts, c, args.prompts)
        runs = []
        for _ in range(args.rounds):
            order = list(settings)
            rng.shuffle(order)
            # plain = the default method at k = 0 (no proposal: decoding as with method "none"); else its auto k
            runs.append({s: decode(engines[s[0]], calls, method, "plain" if s[1] == "none" else "auto", args)[:2]
                         for s in order})
        base = [r[quants[0], "none"] for r in runs]
        for q, m in settings:
            rates = [t / s for t, s in (r[q, m] for r in runs)]
            results.append({"quantization": q, "method": m, "concurrency": c,
                            "tokens_per_s": round(statistics.median(rates), 2),
                            "over_unquantized_plain": round(statistics.median(
                                rate / (bt / bs) for rate, (bt, bs) in zip(rates, base)), 3)})
        print(f"[bench] {c} streams done", file=sys.stderr)
    sizes = {q: weight_bytes(llm.engine.target.model) for q, llm in engines.items()}
    report = {"benchmark": "quantized", "machine": machine_info(first.engine.device), "args": vars(args),
              "cpu_level": os.environ.get("SPECSERVE_CPU_LEVEL", "native"),
              "dtypes": {q: str(llm.engine.dtype) for q, llm in engines.items()}, "weight_bytes": sizes, "results": results}
    lines = [f"| quantization | method | streams | tokens/s | × {quants[0]} plain |", "|---|---|---|---|---|"]
    lines += [f"| {r['quantization']} | {r['method']} | {r['concurrency']} | {r['tokens_per_s']} | "
              f"{r['over_unquantized_plain']}× |" for r in results]
    lines.append("weights (MB): " + ", ".join(f"{q} {b / 1e6:.0f}" for q, b in sizes.items()))
    emit(report, args.out, "\n".join(lines))
    return report


if __name__ == "__main__":
    main()
