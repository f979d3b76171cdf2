"""`--enable-torch-compile` against eager on the demo target, offline (LLM.generate), one engine after the other in
their own processes: start-up time (load + the compiled engine's warm-up), tokens/s at each concurrency, and the
graphs Dynamo compiled during the measured batches (a batch composition the warm-up did not meet compiles then,
and that batch's time includes it).

`python -m bench.compile_speed --quantization int4 --concurrency 1,4,16 --out docs/compile-speed.json`

Greedy, `ignore_eos`, held-out chat questions as plain prompts. The first compiled run on a machine fills Inductor's
disk cache (`TORCHINDUCTOR_CACHE_DIR`); later starts read it: the JSON records which it was only as the measured
start-up time, so say which one you quote. Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench.output import emit


def measure(compiled: bool, quantization: str, method: str, concurrency: list[int], max_tokens: int) -> dict:
    """In this process: one engine, each concurrency level once after one untimed batch at that level."""
    from bench.adaptive import batches
    from bench.prompts import heldout_prompts
    from specserve.engine import LLM, SamplingParams
    from specserve.engine.model.compile import compilations

    t0 = time.perf_counter()
    llm = LLM(quantization=quantization, speculative_method=method, enable_torch_compile=compiled)
    start = time.perf_counter() - t0
    graphs_at_start = compilations()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for c in concurrency:
        work = batches(heldout_prompts(), c, at_least=2 * c)
        g0, t = compilations(), time.perf_counter()
        llm.generate(work[0], params)  # untimed: the level's first batch (a new composition compiles here)
        first = {"first_batch_seconds": time.perf_counter() - t, "graphs_compiled_first_batch": compilations() - g0}
        g0, t = compilations(), time.perf_counter()
        tokens = sum(len(o.output_token_ids) for batch in work[1:] or work for o in llm.generate(batch, params))
        rows.append({"concurrency": c, "tokens_per_s": tokens / (time.perf_counter() - t),
                     "graphs_compiled_while_timed": compilations() - g0} | first)
    return {"compiled": compiled, "start_seconds": start, "graphs_at_start": graphs_at_start, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compile_speed", description=__doc__.splitlines()[0])
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--speculative-method", default="none")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out")
    ap.add_argument("--worker", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cs = [int(c) for c in args.concurrency.split(",")]
    if args.worker:
        print(json.dumps(measure(args.worker == "compiled", args.quantization, args.speculative_method, cs,
                                 args.max_tokens)))
        return 0
    runs = []
    for kind in ("eager", "compiled"):
        cmd = [sys.executable, "-m", "bench.compile_speed", "--worker", kind, "--quantization", args.quantization,
               "--speculative-method", args.speculative_method, "--concurrency", args.concurrency,
               "--max-tokens", str(args.max_tokens)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    from bench.spec_decode import machine_info
    import torch

    eager, compiled = runs
    lines = ["| streams | eager tokens/s | compiled tokens/s | compiled / eager | first batch: eager s, compiled s "
             "(graphs) | graphs compiled while timed |", "|---|---|---|---|---|---|"]
    for e, c in zip(eager["rows"], compiled["rows"]):
        lines.append(f"| {e['concurrency']} | {e['tokens_per_s']:.1f} | {c['tokens_per_s']:.1f} | "
                     f"{c['tokens_per_s'] / e['tokens_per_s']:.2f}x | {e['first_batch_seconds']:.1f}, "
                     f"{c['first_batch_seconds']:.1f} ({c['graphs_compiled_first_batch']}) | "
                     f"{c['graphs_compiled_while_timed']} |")
    lines.append(f"start-up: eager {eager['start_seconds']:.0f} s, compiled {compiled['start_seconds']:.0f} s "
                 f"({compiled['graphs_at_start']} graphs)")
    report = {"quantization": args.quantization, "speculative_method": args.speculative_method,
              "max_tokens": args.max_tokens, "runs": runs, "machine": machine_info(torch.device("cpu"))}
    emit(report, args.out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
