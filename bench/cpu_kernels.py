"""The CPU kernels (engine/model/cpu_kernels: int4 and Q8_0 products, short-query attention, the lean Llama layer)
against torch's kernels, on the demo target: two engines in one process — one built with the kernels, one with
`SPECSERVE_CPU_KERNELS=0` — timed in interleaved rounds at each concurrency, so machine drift hits both alike.
`--against no-amx`: the kernels with their AMX tiles (a bf16 model's int4 products of 6 rows or more) against the
same engine with the tiles switched off for its calls (AVX-512 multiply-adds only). `--against source:FILE.c`: the
same engine on a library built from another kernels.c (an earlier commit's, say: `git show REV:engine/model/
cpu_kernels/kernels.c > /tmp/old.c`), swapped in for its calls (the C interface must match).

`python -m bench.cpu_kernels --methods none,eagle3 --concurrency 1,4,16 --rounds 3 --out docs/cpu-kernels.json`
`python -m bench.cpu_kernels --against no-amx --methods none,ngram --concurrency 1,4,16 --rounds 3`
`python -m bench.cpu_kernels --against source:/tmp/old.c --methods none --concurrency 1,4,16 --rounds 5`
`--against transformers`: the direct forward (engine/model/native_forward.py) against transformers' forward around
the same one-call decoder; the same engine, the direct path off for the baseline's calls.

Offline `LLM.generate`, greedy, `ignore_eos`, held-out chat questions as plain prompts. Reports the median tokens/s
of each engine, the median of the per-round ratios, and the share of requests whose tokens were identical (in bf16
the two engines' arithmetic differs, so near-ties may not be). Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

from bench.output import emit


def build_pair(quantization: str, method: str, **kw):
    from specserve.engine import LLM
    from specserve.engine.model.cpu_kernels import build

    with_kernels = LLM(quantization=quantization, speculative_method=method, **kw)
    if with_kernels.engine.target.kernels is None:
        raise SystemExit("the CPU kernels could not be built here (see the warning above); nothing to compare")
    build.load.cache_clear()
    os.environ[build.ENV_SWITCH] = "0"
    try:
        without = LLM(quantization=quantization, speculative_method=method, **kw)
    finally:
        del os.environ[build.ENV_SWITCH]
        build.load.cache_clear()
    return with_kernels, without


class Switched:
    """The same engine with something switched off for the length of each call: `off()` before, `on()` after."""

    def __init__(self, llm, off, on):
        self.llm, self.off, self.on = llm, off, on

    def generate(self, prompts, params):
        self.off()
        try:
            return self.llm.generate(prompts, params)
        finally:
            self.on()


class WithLibrary:
    """The same engine with another kernels library swapped in for the length of each call (same weights)."""

    def __init__(self, llm, lib):
        from specserve.engine.model.hidden import decoder_layers

        target = llm.engine.target
        self.llm, self.lib = llm, lib
        layers = [getattr(layer, "specserve_native", None) for layer in decoder_layers(target.model)]
        self.holders = [target, *(m for m in target.model.modules() if getattr(m, "kernels", None) is not None),
                        *(n for n in layers if n is not None)]

    def generate(self, prompts, params):
        own = [h.kernels for h in self.holders]
        for h in self.holders:
            h.kernels = self.lib
        try:
            return self.llm.generate(prompts, params)
        finally:
            for h, lib in zip(self.holders, own):
                h.kernels = lib


def source_pair(quantization: str, method: str, source: str, **kw):
    import tempfile
    from pathlib import Path

    from specserve.engine import LLM
    from specserve.engine.model.cpu_kernels import build

    llm = LLM(quantization=quantization, speculative_method=method, **kw)
    cc = build.compiler()
    if llm.engine.target.kernels is None or cc is None:
        raise SystemExit("the CPU kernels could not be built here; nothing to compare")
    target = Path(tempfile.mkdtemp(prefix="specserve-kernels-")) / "other.so"
    # the level this process's own library was built for (SPECSERVE_CPU_LEVEL), so both sides run the same ISA
    build.build(cc, target, march=os.environ.get(build.ENV_LEVEL, "native").strip().lower() or "native",
                source=Path(source))
    return llm, WithLibrary(llm, build.open_library(target, strict=False))


def amx_pair(quantization: str, method: str, **kw):
    from specserve.engine import LLM
    from specserve.engine.model.cpu_kernels import ops

    llm = LLM(quantization=quantization, speculative_method=method, **kw)
    lib = llm.engine.target.kernels
    if lib is None or not ops.amx(lib):
        raise SystemExit("no AMX tiles here (CPU, kernel, build or SPECSERVE_CPU_AMX=0); nothing to compare")
    return llm, Switched(llm, lambda: lib.specserve_amx(0), lambda: lib.specserve_amx(1))


def direct_pair(quantization: str, method: str, **kw):
    """The direct forward (engine/model/native_forward.py) against transformers' forward around the same decoder call
    (the runner's direct path off for the baseline's calls)."""
    from specserve.engine import LLM

    llm = LLM(quantization=quantization, speculative_method=method, **kw)
    runner = llm.engine.target
    direct = runner.native
    if direct is None:
        raise SystemExit("this target has no direct forward (not a Llama-family model on the CPU kernels)")
    return llm, Switched(llm, lambda: setattr(runner, "native", None), lambda: setattr(runner, "native", direct))


def measure(quantization: str, method: str, concurrency: list[int], max_tokens: int, rounds: int,
            against: str = "torch", **kw) -> list[dict]:
    from bench.adaptive import batches
    from bench.prompts import heldout_prompts
    from specserve.engine import SamplingParams

    if against.startswith("source:"):
        engines = source_pair(quantization, method, against.split(":", 1)[1], **kw)
    elif against == "transformers":
        engines = direct_pair(quantization, method, **kw)
    else:
        engines = amx_pair(quantization, method, **kw) if against == "no-amx" else build_pair(quantization, method, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for c in concurrency:
        work = batches(heldout_prompts(), c, at_least=c * (rounds + 1))
        for llm in engines:
            llm.generate(work[0], params)  # untimed warm-up at this level
        speeds: list[list[float]] = [[], []]
        same = total = 0
        for r in range(rounds):
            batch = work[1 + r % (len(work) - 1)] if len(work) > 1 else work[0]
            outs = []
            for i, llm in enumerate(engines):
                t = time.perf_counter()
                got = llm.generate(batch, params)
                speeds[i].append(sum(len(o.output_token_ids) for o in got) / (time.perf_counter() - t))
                outs.append([o.output_token_ids for o in got])
            same += sum(a == b for a, b in zip(*outs))
            total += len(batch)
        ratios = [a / b for a, b in zip(*speeds)]
        rows.append({"method": method, "concurrency": c, "kernels_tokens_per_s": statistics.median(speeds[0]),
                     "baseline": against, "baseline_tokens_per_s": statistics.median(speeds[1]),
                     "ratio_median": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios), "identical_requests": same,
                     "requests": total, "rounds": rounds})
    del engines
    gc.collect()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="auto", help="the engines' dtype (auto: bf16 where the CPU has it natively)")
    ap.add_argument("--methods", default="none,eagle3")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--against", default="torch",
                    help="the baseline: torch (torch's kernels), no-amx (the kernels without their AMX tiles), "
                         "source:FILE.c (a library built from another kernels.c) or transformers (transformers' forward "
                         "around the one-call decoder instead of the direct forward)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.against not in ("torch", "no-amx", "transformers") and not args.against.startswith("source:"):
        ap.error("--against: torch, no-amx, transformers or source:FILE.c")
    cs = [int(c) for c in args.concurrency.split(",")]
    rows = [row for m in args.methods.split(",") for row in measure(args.quantization, m, cs, args.max_tokens,
                                                                     args.rounds, args.against, dtype=args.dtype)]
    import torch

    from bench.spec_decode import machine_info

    base = "other" if args.against.startswith("source:") else args.against
    lines = [f"| method | streams | kernels tok/s | {base} tok/s | kernels / {base} (median, min-max) | identical |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['kernels_tokens_per_s']:.1f} | "
                     f"{r['baseline_tokens_per_s']:.1f} | {r['ratio_median']:.2f}x ({r['ratio_min']:.2f}-"
                     f"{r['ratio_max']:.2f}) | {r['identical_requests']}/{r['requests']} |")
    from specserve.engine.model.cpu_kernels import build

    emit({"quantization": args.quantization, "dtype": args.dtype, "cpu_level": os.environ.get(build.ENV_LEVEL, "native"),
          "max_tokens": args.max_tokens, "rows": rows,
          "machine": machine_info(torch.device("cpu"))}, args.out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
