"""Speculative-decoding benchmark: plain vs k = 1..8 on one engine, interleaved per repeat, plus the raw
verify-cost curve. Prints JSON (stdout or --out) and a markdown table (stderr).

`python -m bench.spec_decode --model M --draft-model D --ks 1,2,4 --max-tokens 128 --repeats 3`
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from bench.output import emit
from specserve.engine import LLM, SamplingParams
from specserve.engine.model.attention import SeqChunk

BUILTIN_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    \"\"\"A last-in, first-out container.\"\"\"\n\n    def __init__(self):\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding",
    "# Parse a CSV file and return a list of dictionaries\nimport csv\n\n",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "Once upon a time, in a small village by the sea,",
    "def read_config(path):\n    with open(path) as f:\n",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.spec_decode", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target model directory (default: the bundled demo target)")
    ap.add_argument("--draft-model", default=None, help="draft model directory (default: the bundled demo draft)")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="comma-separated num_speculative_tokens to compare")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompts-file", default=None, help="a JSON list of strings, or one prompt per line")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batch-size", type=int, default=1, help="prompts per generate() call")
    ap.add_argument("--dtype", default="auto", help="auto = the engine's choice (bf16 where native, else fp32 on CPU)")
    ap.add_argument("--quantization", default="none",
                    help="none (default: the dtype's weights, as docs/ measured) | auto (the server's default) | int8 | int4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="bytes for target + draft KV")
    ap.add_argument("--context", type=int, default=256, help="context length of the verify-cost forwards")
    ap.add_argument("--forward-repeats", type=int, default=30, help="timed forwards per verify-cost point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                    help="send prompts through the target's chat template (default: on for the demo target, "
                         "whose default prompts are then held-out chat questions)")
    ap.add_argument("--out", default=None, help="write the JSON here instead of stdout")
    args = ap.parse_args(argv)
    try:
        args.ks = sorted({int(x) for x in args.ks.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--ks: expected comma-separated integers, got {args.ks!r}")
    if not args.ks or min(args.ks) < 1:
        ap.error("--ks: every k must be >= 1 (k = 0, plain decoding, always runs)")
    for name in ("max_tokens", "num_prompts", "batch_size", "repeats", "forward_repeats", "context"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1")
    return args


def load_prompts(args) -> tuple[list[str], str]:
    if args.prompts_file:
        text = Path(args.prompts_file).read_text(encoding="utf-8")
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError:
            prompts = [line for line in text.splitlines() if line.strip()]
        if not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts) or not prompts:
            raise SystemExit(f"--prompts-file: {args.prompts_file} must hold non-empty strings")
        return prompts[: args.num_prompts], f"file:{args.prompts_file}"
    if args.model is None:  # the demo target is a chat model: questions none of the draft's training used
        from bench.prompts import heldout_prompts
        chat = heldout_prompts()
        return [chat[i % len(chat)] for i in range(args.num_prompts)], "bench.prompts.heldout_prompts"
    held = _heldout_prompts(args)
    if held:
        return held
    return [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(args.num_prompts)], "builtin"


def _heldout_prompts(args) -> tuple[list[str], str] | None:
    """Held-out corpus prompts when the target was trained by specserve.train (its train_summary.json names the
    corpus); None otherwise, or when that corpus is not on this machine."""
    target_dir = Path(args.model)
    summary = target_dir / "train_summary.json"
    if not summary.is_file():
        return None
    try:
        from specserve.train.corpus import heldout_prompts, load_corpus, stdlib_root
        root = json.loads(summary.read_text()).get("corpus")
        # train_target(corpus=None) walks the stdlib's .py files; a path walks all text files: keep the same split
        corpus = load_corpus(None if root in (None, str(stdlib_root())) else root)
        prompts = heldout_prompts(corpus, args.num_prompts)
    except (ImportError, ValueError, OSError) as exc:
        print(f"[bench] held-out prompts unavailable ({exc}); using built-ins", file=sys.stderr)
        return None
    return (prompts, f"heldout:{corpus.root}") if prompts else None


def machine_info(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def forward_costs(llm: LLM, ks: list[int], context: int, batch: int, repeats: int, seed: int) -> dict:
    """Median ms of one raw target forward of n = 1 and k + 1 new tokens per sequence (`batch` sequences at
    `context` tokens of cached context), and of one draft forward of 1 token; cases are interleaved per round."""
    eng = llm.engine
    ns = sorted({1} | {k + 1 for k in ks})
    ctx = max(1, min(context, eng.max_model_len - max(ns)))
    runners = {"target": eng.target}
    if eng.proposer is not None:
        runners["draft"] = eng.proposer.runner
    gen = torch.Generator().manual_seed(seed)
    tables = [eng.allocator.allocate(eng.allocator.blocks_for(ctx + max(ns))) for _ in range(batch)]
    try:
        prefill = torch.randint(0, eng.vocab_size, (batch * ctx,), generator=gen)
        last = torch.arange(1, batch + 1) * ctx - 1
        for runner in runners.values():
            runner.forward(prefill, [SeqChunk(t, 0, ctx) for t in tables], last)

        def once(runner, n: int) -> float:
            ids = torch.randint(0, eng.vocab_size, (batch * n,), generator=gen)
            chunks = [SeqChunk(t, ctx, n) for t in tables]  # same positions every time: the context stays ctx
            rows = torch.arange(batch * n)  # logits at every position, as verification needs
            _sync(eng.device)
            t0 = time.perf_counter()
            runner.forward(ids, chunks, rows)
            _sync(eng.device)
            return time.perf_counter() - t0

        cases = [("target", n) for n in ns] + ([("draft", 1)] if "draft" in runners else [])
        times: dict = {c: [] for c in cases}
        for r in range(3 + repeats):  # 3 warm-up rounds
            for name, n in cases:
                dt = once(runners[name], n)
                if r >= 3:
                    times[(name, n)].append(dt)
    finally:
        for t in tables:
            eng.allocator.free(t)
    ms = {c: 1000 * statistics.median(v) for c, v in times.items()}
    base = ms[("target", 1)]
    out = {"context_tokens": ctx, "batch_size": batch, "repeats": repeats,
           "target_ms": {str(n): round(ms[("target", n)], 4) for n in ns},
           "verify_cost": {str(k): round(ms[("target", k + 1)] / base, 4) for k in ks}}
    if ("draft", 1) in ms:
        out["draft_ms_1"] = round(ms[("draft", 1)], 4)
        out["c"] = round(ms[("draft", 1)] / base, 4)
    return out


def run_config(llm: LLM, prompts: list[str], k: int, args) -> tuple[list, float]:
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                             num_speculative_tokens=k, seed=args.seed + i if args.temperature > 0 else None)
              for i in range(len(prompts))]
    outs, wall = [], 0.0
    for s in range(0, len(prompts), args.batch_size):
        _sync(llm.engine.device)
        t0 = time.perf_counter()
        outs += llm.generate(prompts[s:s + args.batch_size], params[s:s + args.batch_size])
        _sync(llm.engine.device)
        wall += time.perf_counter() - t0
    return outs, wall


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def speculation_counts(outs) -> dict:
    """Proposed / accepted / verify steps over outputs, with vLLM's acceptance rate and mean accepted length."""
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    accepted = sum(o.speculation.num_accepted_tokens for o in outs)
    steps = sum(o.speculation.num_steps for o in outs)
    return {"num_draft_tokens": drafted, "num_accepted_tokens": accepted, "num_steps": steps,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "mean_accepted_length": round(1 + accepted / steps, 4) if steps else None}


def summarise(ks, runs, costs, greedy: bool) -> list[dict]:
    """runs[rep][k] = (outputs, wall seconds). Speedup = median over repeats of the within-repeat ratio."""
    rows = []
    plain_tps = [sum(len(o.output_token_ids) for o in r[0][0]) / r[0][1] for r in runs]
    for k in [0] + ks:
        tps = [sum(len(o.output_token_ids) for o in r[k][0]) / r[k][1] for r in runs]
        ratios = [t / p for t, p in zip(tps, plain_tps)]
        outs = [o for r in runs for o in r[k][0]]
        row = {"k": k, "tokens_per_s": round(statistics.median(tps), 3),
               "tokens_per_s_per_repeat": [round(t, 3) for t in tps],
               "wall_s_per_repeat": [round(r[k][1], 4) for r in runs],
               "generated_tokens_per_repeat": [sum(len(o.output_token_ids) for o in r[k][0]) for r in runs],
               "speedup": round(statistics.median(ratios), 4), "speedup_per_repeat": [round(x, 4) for x in ratios],
               **speculation_counts(outs), "verify_cost": 1.0 if k == 0 else costs["verify_cost"][str(k)]}
        if k and row["num_steps"] and "c" in costs:  # ideal: tokens per step / (k draft forwards + one verify), in target steps
            row["model_speedup"] = round(row["mean_accepted_length"] / (k * costs["c"] + row["verify_cost"]), 4)
        if greedy:  # k = 0: plain is deterministic across repeats; k > 0: equals plain of the same repeat
            diffs = []
            for rep, r in enumerate(runs):
                ref = runs[0][0][0] if k == 0 else r[0][0]
                for i, (o, p) in enumerate(zip(r[k][0], ref)):
                    d = first_diff(o.output_token_ids, p.output_token_ids)
                    if d is not None:
                        diffs.append({"repeat": rep, "prompt": i, "first_diff_token": d})
            row["greedy_identical"] = not diffs
            row["greedy_mismatches"] = diffs[:20]
        else:
            row["greedy_identical"] = None
        rows.append(row)
    return rows


def _fmt(x, spec: str = ".3f", none: str = "–") -> str:
    return none if x is None else format(x, spec)


def table(rows: list[dict], costs: dict, info: dict, args, num_prompts: int) -> str:
    lines = [f"machine: {info['cpu']} | threads {info['torch_threads']} | torch {info['torch']} | {args.dtype} | "
             f"batch {args.batch_size} | {num_prompts} prompts x {args.max_tokens} tokens x {args.repeats} repeats",
             f"target forward, 1 token at {costs['context_tokens']} context: {costs['target_ms']['1']:.2f} ms"
             + (f"; draft: {costs['draft_ms_1']:.2f} ms (c = {costs['c']:.3f})" if "c" in costs else ""), "",
             "| k | tokens/s | speedup | acceptance rate | mean accepted length | verify cost (k+1)/1 | greedy identical "
             "| model speedup |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = r["speedup_per_repeat"]
        spread = f" ({min(sp):.2f}–{max(sp):.2f})" if len(sp) > 1 and r["k"] else ""
        lines.append(f"| {r['k'] or '0 (plain)'} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x{spread} | "
                     f"{_fmt(r['acceptance_rate'])} | {_fmt(r['mean_accepted_length'], '.2f')} | "
                     f"{r['verify_cost']:.2f} | {_fmt(r['greedy_identical'], '')} | "
                     f"{_fmt(r.get('model_speedup'), '.2f')}x |".replace("–x", "–"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts, source = load_prompts(args)
    llm = LLM(model=args.model, draft_model=args.draft_model, num_speculative_tokens=max(args.ks), dtype=args.dtype,
              quantization=args.quantization,
              device=args.device, kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.batch_size, 1),
              seed=args.seed)
    args.dtype = str(llm.engine.dtype).removeprefix("torch.")  # what `auto` resolved to, for the report
    if llm.engine.proposer is None:
        raise SystemExit("no draft model: give --draft-model (speculation needs a proposer)")
    args.ignore_eos = True  # fixed-length runs; a chat answer instead ends at its end-of-turn token
    if args.chat if args.chat is not None else args.model is None:
        args.ignore_eos = False
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=False) for p in prompts]
        source += "+chat_template"
    info = machine_info(llm.engine.device)
    info["loadavg_start"] = list(os.getloadavg())
    for k in (0, max(args.ks)):  # warm-up: first calls allocate and pick kernels
        llm.generate(prompts[: args.batch_size], SamplingParams(temperature=args.temperature, max_tokens=16,
                                                                 ignore_eos=True, num_speculative_tokens=k))
    costs = forward_costs(llm, args.ks, args.context, args.batch_size, args.forward_repeats, args.seed)
    runs = []
    for rep in range(args.repeats):
        runs.append({k: run_config(llm, prompts, k, args) for k in [0] + args.ks})
        print(f"[bench] repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    info["loadavg_end"] = list(os.getloadavg())
    rows = summarise(args.ks, runs, costs, greedy=args.temperature == 0)
    params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    doc = {"benchmark": "spec_decode", "machine": info, "args": vars(args), "prompt_source": source,
           "num_prompt_tokens": [len(llm.engine.tokenize(p)) for p in prompts],
           "target_params": params(llm.engine.target.model), "draft_params": params(llm.engine.proposer.runner.model),
           "forward_costs": costs, "rows": rows}
    emit(doc, args.out, table(rows, costs, info, args, len(prompts)))
    return doc


if __name__ == "__main__":
    main()
