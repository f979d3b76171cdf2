"""The direct forward (engine/model/native_forward.py: embedding, the one-call decoder, norm and head without
transformers' model code; attention views built from the chunks) against a baseline in the same engine, rounds
alternating which goes first:

- `--against transformers`: transformers' forward around the same one-call decoder (the runner's direct path off);
- `--against query-groups`: the direct path with its attention view built from build_metadata's query groups.

`python -m bench.native_forward --against transformers --concurrency 1,4,16 --rounds 6 --out docs/native-forward.json`

Offline, greedy, `ignore_eos`, held-out chat prompts, int4 demo target in bf16 by default; also counts requests whose
tokens are identical both ways (they should all be: the same kernels in the same order). Prints JSON (stdout or
--out) and a markdown table (stderr). Nothing else should run meanwhile."""

from __future__ import annotations

import argparse
import statistics
import time

from bench.output import emit
from bench.prompts import heldout_prompts
from specserve.engine import LLM, SamplingParams
from specserve.engine.model.attention import build_metadata
from specserve.engine.model.native_forward import NativeForward

AGAINST = ("transformers", "query-groups")


def _through_query_groups(self, input_ids, kv, chunks, logits_index, kernels):
    """forward_causal as it was before causal_groups: build_metadata's groups, then the direct forward."""
    md, positions = build_metadata(kv, chunks, input_ids.device, False, kernels=kernels)
    return self.forward(input_ids, positions, md, logits_index)


def measure(llm: LLM, concurrency: int, against: str, rounds: int, max_tokens: int, method: str | None) -> dict:
    runner, direct, causal = llm.engine.target, llm.engine.target.native, NativeForward.forward_causal
    if direct is None:
        raise SystemExit("this target has no direct forward (not a Llama model on the CPU kernels)")

    def switch(on: bool) -> None:
        if against == "transformers":
            runner.native = direct if on else None
        else:
            NativeForward.forward_causal = causal if on else _through_query_groups

    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in heldout_prompts()][:concurrency]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            num_speculative_tokens=0 if method == "none" else None)
    speeds, outputs = {True: [], False: []}, {}
    try:
        llm.generate(prompts, params)  # warm-up
        for r in range(rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                switch(on)
                t = time.perf_counter()
                outs = llm.generate(prompts, params)
                speeds[on].append(sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - t))
                outputs.setdefault(on, []).append([o.output_token_ids for o in outs])
    finally:
        switch(True)
    ratios = [a / b for a, b in zip(speeds[True], speeds[False])]
    same = sum(a == b for x, y in zip(outputs[True], outputs[False]) for a, b in zip(x, y))
    return {"concurrency": concurrency, "direct_tokens_per_s": statistics.median(speeds[True]),
            "baseline_tokens_per_s": statistics.median(speeds[False]), "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "identical_requests": same,
            "requests": rounds * len(prompts), "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.native_forward", description=__doc__.splitlines()[0])
    ap.add_argument("--against", choices=AGAINST, default="transformers")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--method", choices=("none", "default"), default="none",
                    help="none: plain decoding; default: the target's default speculative method (auto k)")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import torch

    from bench.spec_decode import machine_info

    cs = [int(c) for c in args.concurrency.split(",")]
    llm = LLM(model=None, dtype="auto", quantization=args.quantization, max_num_seqs=max(cs), seed=0)
    rows = [measure(llm, c, args.against, args.rounds, args.max_tokens, args.method) for c in cs]
    lines = [f"| streams | direct tok/s | {args.against} tok/s | direct / {args.against} (median, min-max) | "
             "identical |", "|---|---|---|---|---|"]
    lines += [f"| {r['concurrency']} | {r['direct_tokens_per_s']:.1f} | {r['baseline_tokens_per_s']:.1f} | "
              f"{r['ratio_median']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | "
              f"{r['identical_requests']}/{r['requests']} |" for r in rows]
    emit({"bench": "native_forward", "against": args.against, "method": args.method,
          "quantization": args.quantization, "max_tokens": args.max_tokens,
          "machine": machine_info(torch.device("cpu")), "rows": rows}, args.out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
