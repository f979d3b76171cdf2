"""The weight-only kernels against the dtype's matmul, per shape: the demo target's linear layers (576 -> 576, 576 ->
192, 576 -> 1536, 1536 -> 576) at the row counts a step computes (decode 1, verify k + 1, batches), in one process,
interleaved repeats. Reports microseconds per call of the whole decoder's linear work (the sum over one layer's
seven projections) and the ratio to the dtype's dense matmul.

`python -m bench.quant_kernels --rows 1,2,5,8,16,32,64,128 --out docs/quant-kernels.json`

Prints JSON (stdout or --out) and a markdown table (stderr).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from bench.output import emit
from bench.spec_decode import machine_info
from specserve.engine.model.quantize import Int4Linear, Int8Linear

# (in, out) of one SmolLM2-135M decoder layer's projections: q, k, v, o, gate, up, down
LAYER = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]


def layer_modules(dtype: torch.dtype) -> dict[str, list[nn.Module]]:
    torch.manual_seed(0)
    dense = [nn.Linear(i, o, bias=False) for i, o in LAYER]
    return {"dense": [d.to(dtype) for d in dense], "int8": [Int8Linear(d, dtype) for d in dense],
            "int4": [Int4Linear(d, dtype) for d in dense]}


def time_layer(mods: list[nn.Module], rows: int, dtype: torch.dtype, calls: int) -> float:
    xs = {i: torch.randn(rows, i, dtype=dtype) for i, _ in LAYER}
    with torch.inference_mode():
        for m, (i, _) in zip(mods, LAYER):
            m(xs[i])
        t0 = time.perf_counter()
        for _ in range(calls):
            for m, (i, _) in zip(mods, LAYER):
                m(xs[i])
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.quant_kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,5,8,16,32,64,128")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    mods = layer_modules(dtype)
    rows = [int(r) for r in args.rows.split(",")]
    samples = {(k, r): [] for k in mods for r in rows}
    for _ in range(args.repeats):
        for r in rows:
            for k, m in mods.items():  # interleaved: each repeat visits every kernel at every row count
                samples[k, r].append(time_layer(m, r, dtype, args.calls))
    results = [{"rows": r, **{f"{k}_us": round(statistics.median(samples[k, r]), 1) for k in mods},
                **{f"{k}_over_dense": round(statistics.median(samples[k, r]) / statistics.median(samples["dense", r]), 3)
                   for k in ("int8", "int4")}} for r in rows]
    report = {"benchmark": "quant_kernels", "machine": machine_info(torch.device("cpu")), "args": vars(args),
              "results": results}
    lines = [f"| rows | dense {args.dtype} µs/layer | int8 µs (× dense) | int4 µs (× dense) |", "|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['dense_us']} | {r['int8_us']} ({r['int8_over_dense']}×) | {r['int4_us']} "
              f"({r['int4_over_dense']}×) |" for r in results]
    emit(report, args.out, "\n".join(lines))
    return report


if __name__ == "__main__":
    main()
