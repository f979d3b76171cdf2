"""What `auto` planned against what a fixed k does, request by request: one method, the same prompts decoded one at a
time with a fixed k and with auto, alternating; a spy on the adaptive plan (the k it planned per step) and on the
proposer (the lengths it was asked for), and each run's verified-k histogram. When auto and the fixed k make the
same decisions, any speed difference between them is the machine's.

`python -m bench.plan_spy --method ngram --workload grounded --fixed-k 4 --repeats 2 --out /tmp/plan-spy.json`

Greedy. Prints JSON (stdout or --out) and one line per run (stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

from bench.methods import grounded_tasks
from bench.output import emit
from bench.prompts import heldout_prompts
from specserve.engine import LLM, SamplingParams


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.plan_spy", description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--workload", default="grounded", choices=("chat", "grounded"))
    ap.add_argument("--fixed-k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    config = [{"method": args.method, "num_speculative_tokens": "auto", "max_speculative_tokens": args.fixed_k}]
    llm = LLM(speculative_config=json.dumps(config), quantization=args.quantization, kv_cache_memory=1 << 30, seed=0)
    core = llm.engine

    def chat(text: str) -> str:
        return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
    texts = heldout_prompts() if args.workload == "chat" else [t for t, _ in grounded_tasks(len(heldout_prompts()))]
    prompts = [chat(t) for t in texts[: args.prompts]]
    llm.generate(prompts[0], SamplingParams(max_tokens=8))  # warm-up
    asked: Counter = Counter()
    planned: Counter = Counter()
    proposer, controller = core.proposers[args.method], core.controller
    propose, plan = proposer.propose, controller.plan

    def propose_spy(requests, ks, generator):
        asked.update(ks)
        return propose(requests, ks, generator)

    def plan_spy(running):
        plan(running)
        planned.update(r.planned_k for r in running if r.adaptive and r.planned_k is not None)
    proposer.propose, controller.plan = propose_spy, plan_spy
    runs = []
    for _ in range(args.repeats):
        for setting in (f"k={args.fixed_k}", "auto"):
            asked.clear()
            planned.clear()
            k = None if setting == "auto" else args.fixed_k
            tokens, verified, t0 = 0, Counter(), time.perf_counter()
            for p in prompts:  # one stream
                out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                       speculative_method=args.method, num_speculative_tokens=k))[0]
                tokens += len(out.output_token_ids)
                verified.update(out.speculation.steps_by_k)
            seconds = time.perf_counter() - t0
            run = {"setting": setting, "tokens_per_s": round(tokens / seconds, 2),
                   "verified_k": {str(k): n for k, n in sorted(verified.items())},
                   "planned_k": {str(k): n for k, n in sorted(planned.items())},
                   "asked_k": {str(k): n for k, n in sorted(asked.items())}}
            runs.append(run)
            print(f"[bench] {json.dumps(run)}", file=sys.stderr)
    report = {"benchmark": "plan_spy", "args": vars(args), "runs": runs}
    emit(report, args.out)
    return report


if __name__ == "__main__":
    main()
