"""Resident memory of an idle engine: for each configuration, a fresh Python process loads `LLM(...)` (the demo target
with its default method unless told otherwise), decodes one short prompt, and reports its VmRSS and VmHWM (peak)
from /proc/self/status; a process with only torch and transformers imported is the floor.

`python -m bench.rss --configs none,int8,int4,int4:16 --out docs/rss.json`

A config is a quantization (none | int8 | int4), optionally `:N` for --quantization-dense-rows N. Linux only. Prints
JSON (stdout or --out) and a markdown table (stderr).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from bench.output import emit

CHILD = r"""
import json, sys
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}
args = json.loads(sys.argv[1])
import torch, transformers  # noqa: E401,F401  the floor: what any torch + transformers server holds
if args["config"] == "floor":
    print(json.dumps(status()))
    raise SystemExit
from specserve.engine import LLM, SamplingParams
quant, _, rows = args["config"].partition(":")
llm = LLM(model=args["model"], quantization=None if quant == "none" else quant,
          quantization_dense_rows=int(rows or 0), kv_cache_memory=args["kv_cache_memory"], seed=0)
llm.generate("Hello", SamplingParams(max_tokens=8))
print(json.dumps(status()))
"""


def measure(config: str, model: str | None, kv_cache_memory: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"config": config, "model": model,
                                                                    "kv_cache_memory": kv_cache_memory})],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(report: dict) -> str:
    lines = ["| config | idle RSS MB | peak RSS MB |", "|---|---|---|"]
    for row in report["results"]:
        lines.append(f"| {row['config']} | {row['VmRSS'] / 2**20:.0f} | {row['VmHWM'] / 2**20:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.rss", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (default: the demo target)")
    ap.add_argument("--configs", default="none,int8,int4")
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20,
                    help="bytes of KV cache (allocated at start, part of the RSS)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    configs = ["floor", *[c for c in args.configs.split(",") if c.strip()]]
    results = [{"config": c, **measure(c, args.model, args.kv_cache_memory)} for c in configs]
    report = {"benchmark": "rss", "args": vars(args), "results": results}
    emit(report, args.out, table(report))
    return report


if __name__ == "__main__":
    main()
