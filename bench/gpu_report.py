"""One table of a bench/gpu.sh run: every bench.spec_decode JSON in its directory, plus the environment.

Writes DIR/summary.json and prints the markdown table; a run cut short reports what it has.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.output import emit


def collect(root: Path) -> dict:
    env_file = root / "env.json"
    env = json.loads(env_file.read_text()) if env_file.is_file() else {}
    rows = []
    for path in sorted(root.glob("*-b*.json")):
        doc = json.loads(path.read_text())
        if doc.get("benchmark") != "spec_decode":
            continue
        tag, pair = path.stem.split("-", 1)
        pair = pair.rsplit("-b", 1)[0]
        args = doc["args"]
        for row in doc["rows"]:
            rows.append({"check": tag, "pair": pair, "dtype": args["dtype"], "batch": args["batch_size"],
                         "k": row["k"], "tokens_per_s": row["tokens_per_s"], "speedup": row["speedup"],
                         "acceptance_rate": row["acceptance_rate"], "greedy_identical": row["greedy_identical"],
                         "target_ms_1": doc["forward_costs"]["target_ms"]["1"], "file": path.name})
    return {"benchmark": "gpu", "environment": env, "rows": rows,
            # the identity is a rule in fp32 only: bf16 rounding may flip a near-tie between batch shapes
            "fp32_greedy_identical": all(r["greedy_identical"] is not False for r in rows if r["dtype"] == "float32")}


def table(doc: dict) -> str:
    env = doc["environment"]
    lines = [f"device: {env.get('gpu', env.get('device', '?'))} | torch {env.get('torch', '?')} | "
             f"CUDA {env.get('cuda')} | fp32 greedy identical everywhere: {doc['fp32_greedy_identical']} (bf16 rows may "
             "differ: rounding flips near-ties between batch shapes)", "",
             "| check | pair | dtype | batch | k | tokens/s | speedup | acceptance | greedy identical | target ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        acc = "–" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        same = "–" if r["greedy_identical"] is None else str(r["greedy_identical"])
        lines.append(f"| {r['check']} | {r['pair']} | {r['dtype']} | {r['batch']} | {r['k'] or 'plain'} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {acc} | {same} | {r['target_ms_1']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_report", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="the directory bench/gpu.sh wrote")
    args = ap.parse_args(argv)
    doc = collect(args.dir)
    emit(doc, str(args.dir / "summary.json"))
    print(table(doc))
    return doc


if __name__ == "__main__":
    main()
