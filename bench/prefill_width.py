"""Prefill on whole native layers against the op-by-op forward, by prompt length: the time of the step that prefills
one prompt of random token ids (max_tokens 1, prefix caching off), with fast_layers.NATIVE_QUERY as shipped and set
to 0 (every prefill chunk op by op, SDPA attention); each round times both, alternating which goes first.

`python -m bench.prefill_width --lengths 20,40,80,160,320,384,512 --rounds 3 --out docs/prefill-width.json`

Also checks that both settings pick the same first token. Prints JSON (stdout or --out) and a markdown table
(stderr). Nothing else should run meanwhile."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.output import emit
from specserve.engine import LLM, SamplingParams
from specserve.engine.model import fast_layers


def measure(llm: LLM, lengths: list[int], rounds: int) -> list[dict]:
    core, shipped = llm.engine, fast_layers.NATIVE_QUERY
    step, seconds = core.step, []

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = step(*args, **kwargs)
        seconds.append(time.perf_counter() - t)
        return out
    core.step = timed
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, num_speculative_tokens=0)
    gen, rows = torch.Generator().manual_seed(0), []
    try:
        for n in lengths:
            times, same = {shipped: [], 0: []}, True
            for r in range(rounds):
                ids = torch.randint(100, min(llm.tokenizer.vocab_size, 40000), (n,), generator=gen).tolist()
                firsts = []
                for width in ((shipped, 0) if r % 2 == 0 else (0, shipped)):
                    fast_layers.NATIVE_QUERY = width
                    seconds.clear()
                    firsts.append(llm.generate(ids, params)[0].output_token_ids)
                    times[width].append(max(seconds))  # the prefill step (the only one)
                same = same and firsts[0] == firsts[1]
            native, op = statistics.median(times[shipped]), statistics.median(times[0])
            rows.append({"prompt_tokens": n, "native_ms": 1000 * native, "op_by_op_ms": 1000 * op,
                         "speedup": op / native, "same_first_token": same, "rounds": rounds})
    finally:
        fast_layers.NATIVE_QUERY, core.step = shipped, step
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill_width", description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="20,40,80,160,320,384,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from bench.spec_decode import machine_info

    llm = LLM(model=None, dtype=args.dtype, quantization=args.quantization, max_num_seqs=1, seed=0,
              enable_prefix_caching=False)
    rows = measure(llm, [int(n) for n in args.lengths.split(",")], args.rounds)
    lines = [f"| prompt tokens | native ms (NATIVE_QUERY {fast_layers.NATIVE_QUERY}) | op by op ms | speedup | "
             "same first token |", "|---|---|---|---|---|"]
    lines += [f"| {r['prompt_tokens']} | {r['native_ms']:.1f} | {r['op_by_op_ms']:.1f} | {r['speedup']:.2f}x | "
              f"{r['same_first_token']} |" for r in rows]
    emit({"bench": "prefill_width", "native_query": fast_layers.NATIVE_QUERY, "quantization": args.quantization,
          "dtype": args.dtype, "machine": machine_info(torch.device("cpu")), "rows": rows}, args.out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
