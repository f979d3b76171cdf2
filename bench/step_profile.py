"""Where a decode step's time goes: the engine's step split into its phases (planning, scheduling, proposing, the
target forward's metadata and model call, verification with detokenisation, proposer bookkeeping, outputs), timed
by wrapping each phase's method on one engine, for plain decoding, the default method (auto k) and fixed k, at each
concurrency. "other" is the step's time outside every named phase.

`python -m bench.step_profile --concurrency 1,16,32 --out docs/step-profile.json`
`python -m bench.step_profile --quantization auto --method eagle3 --settings plain,k=1,k=2,k=3,default --concurrency 1,4`

Greedy, `ignore_eos` (every request decodes max_tokens: the profile is of the step, not of acceptance). Prints JSON
(stdout or --out) and a markdown table (stderr). Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import defaultdict

import torch

from bench.adaptive import batches
from bench.output import emit
from bench.prompts import heldout_prompts
from bench.spec_decode import machine_info
from specserve.engine import LLM, SamplingParams
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.model import runner as runner_module

# (label, parent) in the order printed; a child's time is part of its parent's
PHASES = [("plan", None), ("schedule", None), ("propose", None), ("target_forward", None),
          ("metadata", "target_forward"), ("model", "target_forward"), ("verify", None),
          ("detokenize", "verify"), ("after_step", None), ("outputs", None)]


class PhaseTimer:
    """Seconds per phase, summed over the steps; wraps callables in place and puts them back on `restore()`."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1
        self._undo.append((owner, name, vars(owner).get(name)))  # None: a method of the class, not the instance
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._undo.clear()


def instrument(llm: LLM, timer: PhaseTimer) -> None:
    core = llm.engine
    timer.wrap(core, "step", "step")
    timer.wrap(core.controller, "plan", "plan")
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(core, "_propose", "propose")
    timer.wrap(core, "_target_forward", "target_forward")
    timer.wrap(runner_module, "build_metadata", "metadata")
    timer.wrap(core.target.model, "forward", "model")
    timer.wrap(core, "_verify_and_update", "verify")
    timer.wrap(IncrementalDetokenizer, "append", "detokenize")
    timer.wrap(core.router, "after_step", "after_step")
    timer.wrap(core, "_step_outputs", "outputs")


def profile(llm: LLM, calls: list[list[str]], k: int | None, max_tokens: int) -> dict:
    """Milliseconds per step of each phase over the calls' generate()s (k: 0 plain, None the default method)."""
    timer = PhaseTimer()
    instrument(llm, timer)
    tokens = 0
    try:
        for prompts in calls:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k)
            tokens += sum(len(o.output_token_ids) for o in llm.generate(prompts, params))
    finally:
        timer.restore()
    steps = timer.calls["step"]
    total = timer.seconds["step"]
    top = sum(timer.seconds[label] for label, parent in PHASES if parent is None)
    ms = {label: round(1e3 * timer.seconds[label] / steps, 3) for label, _ in PHASES}
    ms["other"] = round(1e3 * (total - top) / steps, 3)
    return {"steps": steps, "tokens": tokens, "tokens_per_step": round(tokens / steps, 3),
            "step_ms": round(1e3 * total / steps, 3), "phase_ms": ms,
            "outside_model": round(1 - timer.seconds["model"] / total, 3)}


def setting_k(setting: str) -> int | None:
    """plain -> 0, default -> None (auto), k=N -> N."""
    if setting == "plain":
        return 0
    if setting == "default":
        return None
    if setting.startswith("k=") and setting[2:].isdigit():
        return int(setting[2:])
    raise SystemExit(f"--settings: {setting!r} is not plain, default or k=N")


def table(report: dict) -> str:
    labels = [label for label, _ in PHASES] + ["other"]
    lines = ["| setting | streams | tokens / step | step ms | " + " | ".join(labels) + " | outside the model |",
             "|---|---|---|---|" + "---|" * len(labels) + "---|"]
    for row in report["results"]:
        lines.append(f"| {row['setting']} | {row['concurrency']} | {row.get('tokens_per_step', '–')} | "
                     f"{row['step_ms']} | "
                     + " | ".join(str(row["phase_ms"][label]) for label in labels)
                     + f" | {row['outside_model']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (default: the demo target, with its default method)")
    ap.add_argument("--concurrency", default="1,16,32")
    ap.add_argument("--settings", default="plain,default",
                    help="plain (k = 0), default (the method with auto k) and/or k=N (the method at a fixed k)")
    ap.add_argument("--method", default=None, help="the speculative method (default: the demo default's)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per setting at least (c per generate() call)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none", help="none (default) | auto (the server's default) | int8 | int4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    settings = [s for s in args.settings.split(",") if s.strip()]
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization, max_num_seqs=max(concurrency),
              seed=0, speculative_method=args.method)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=False) for q in heldout_prompts()]
    llm.generate(prompts[0], SamplingParams(max_tokens=8))  # warm-up
    results = []
    for c in concurrency:
        calls = batches(prompts, c, args.prompts)
        for setting in settings:
            row = profile(llm, calls, setting_k(setting), args.max_tokens)
            results.append({"setting": setting, "concurrency": c, **row})
            print(f"[bench] {setting} at {c} streams done", file=sys.stderr)
    report = {"benchmark": "step_profile", "machine": machine_info(llm.engine.device), "args": vars(args),
              "torch_threads": torch.get_num_threads(), "results": results}
    emit(report, args.out, table(report))
    return report


if __name__ == "__main__":
    main()
