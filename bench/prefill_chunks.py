"""A long prompt's prefill (time to its first token) with prompts cut into chunks of at most NATIVE_QUERY tokens, as
the engine ships where layers run whole on the CPU kernels (every forward then keeps the same per-row arithmetic:
tests/engine/test_batch_invariance.py), against chunks as wide as the token budget (then op by op with SDPA), one
engine, the two alternating in each round; random token ids, max_tokens 1, prefix caching off.

`python -m bench.prefill_chunks --length 2900 --rounds 3 --out docs/prefill-chunks.json`
(`--dtype float32` and `SPECSERVE_CPU_LEVEL=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` for what an
AVX2 CPU runs)

Also checks both pick the same first token. Prints JSON (stdout or --out) and a markdown table (stderr)."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.output import emit
from bench.spec_decode import machine_info
from specserve.engine import LLM, SamplingParams


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill_chunks", description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=2900)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    llm = LLM(dtype=args.dtype, speculative_method="none", enable_prefix_caching=False, kv_cache_memory=512 << 20,
              max_num_batched_tokens=args.max_num_batched_tokens)
    scheduler = llm.engine.scheduler
    shipped = scheduler.max_prefill_chunk
    settings = {"chunks_as_shipped": shipped, "chunks_of_the_budget": args.max_num_batched_tokens}
    g = torch.Generator().manual_seed(0)
    seconds: dict[str, list[float]] = {name: [] for name in settings}
    firsts: dict[str, list[int]] = {name: [] for name in settings}
    llm.generate(list(range(100, 164)), SamplingParams(max_tokens=1))  # warm-up
    for r in range(args.rounds):
        ids = torch.randint(100, 40000, (args.length,), generator=g).tolist()
        order = list(settings) if r % 2 == 0 else list(reversed(settings))
        for name in order:
            scheduler.max_prefill_chunk = settings[name]
            t = time.perf_counter()
            out = llm.generate(ids, SamplingParams(max_tokens=1))[0]
            seconds[name].append(time.perf_counter() - t)
            firsts[name].append(out.output_token_ids[0])
    scheduler.max_prefill_chunk = shipped
    medians = {name: statistics.median(v) for name, v in seconds.items()}
    report = {"benchmark": "prefill_chunks", "machine": machine_info(torch.device("cpu")), "args": vars(args),
              "cpu_level": os.environ.get("SPECSERVE_CPU_LEVEL", "native"), "dtype": str(llm.engine.dtype),
              "max_prefill_chunk_shipped": shipped, "seconds": seconds, "median_s": medians,
              "shipped_over_budget": round(medians["chunks_as_shipped"] / medians["chunks_of_the_budget"], 3),
              "same_first_tokens": firsts["chunks_as_shipped"] == firsts["chunks_of_the_budget"]}
    table = "\n".join(["| chunks | median s | rounds |", "|---|---|---|",
                       *(f"| {name} ({settings[name]}) | {medians[name]:.2f} | "
                         f"{', '.join(f'{x:.2f}' for x in seconds[name])} |" for name in settings),
                       f"as shipped / budget-wide: {report['shipped_over_budget']}x, same first tokens: "
                       f"{report['same_first_tokens']}"])
    emit(report, args.out, table)
    return report


if __name__ == "__main__":
    main()
