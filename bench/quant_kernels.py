"""The weight-only kernels against the dtype's matmul, per shape: the demo target's linear layers (576 -> 576, 576 ->
192, 576 -> 1536, 1536 -> 576) at the row counts a step computes (decode 1, verify k + 1, batches), in one process,
interleaved repeats. Every layer has its own weights (30 layers, as the model has: 212 MB in bf16, so the weights
stream from memory as in a real step instead of sitting in cache). Reports milliseconds of the whole decoder's linear
work per step and the ratio to the dtype's dense matmul. Where the engine's CPU kernels build, also int4 on them
(`int4_cpu`: AVX-512 only, the AMX tiles switched off for its calls) and, on a CPU with AMX, `int4_cpu_amx` (the
same weights, tiles from AMX_MIN_ROWS rows: bf16 only).

`python -m bench.quant_kernels --rows 1,2,5,8,16,32,64,128 --out docs/quant-kernels.json` (the decoder's
projections, not the output head, which stays in the model's dtype)

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


def layer_modules(dtype: torch.dtype, layers: int, kernels=None) -> dict[str, list[nn.Module]]:
    torch.manual_seed(0)
    out: dict[str, list[nn.Module]] = {"dense": [], "int8": [], "int4": []}
    if kernels is not None:
        out["int4_cpu"] = []
    for _ in range(layers):
        for i, o in LAYER:
            d = nn.Linear(i, o, bias=False)
            out["int8"].append(Int8Linear(d, dtype))
            out["int4"].append(Int4Linear(d, dtype))
            if kernels is not None:
                out["int4_cpu"].append(Int4Linear(d, dtype, kernels=kernels))
            out["dense"].append(d.to(dtype))
    if kernels is not None and dtype == torch.bfloat16 and kernels.specserve_amx_on():
        out["int4_cpu_amx"] = out["int4_cpu"]  # the same modules, timed with the tiles on
    return out


def amx_for(kernels, kind: str) -> None:
    """The tiles on for `int4_cpu_amx` only (the process's switch; build.load turned them on where they exist)."""
    if kernels is not None and kernels.specserve_amx_on() != (kind == "int4_cpu_amx"):
        kernels.specserve_amx(int(kind == "int4_cpu_amx"))


def time_model(mods: list[nn.Module], rows: int, dtype: torch.dtype, calls: int) -> float:
    """Milliseconds of one pass over every layer's projections at `rows` rows."""
    xs = {i: torch.randn(rows, i, dtype=dtype) for i, _ in LAYER}
    shapes = [LAYER[j % len(LAYER)][0] for j in range(len(mods))]
    with torch.inference_mode():
        for m, i in zip(mods, shapes):
            m(xs[i])
        t0 = time.perf_counter()
        for _ in range(calls):
            for m, i in zip(mods, shapes):
                m(xs[i])
    return (time.perf_counter() - t0) / calls * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.quant_kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,5,8,16,32,64,128")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    from specserve.engine.model.cpu_kernels import build

    kernels = build.load()
    mods = layer_modules(dtype, args.layers, kernels)
    rows = [int(r) for r in args.rows.split(",")]
    samples = {(k, r): [] for k in mods for r in rows}
    was = kernels is not None and kernels.specserve_amx_on()
    try:
        for _ in range(args.repeats):
            for r in rows:
                for k, m in mods.items():  # interleaved: each repeat visits every kernel at every row count
                    amx_for(kernels, k)
                    samples[k, r].append(time_model(m, r, dtype, args.calls))
    finally:
        if kernels is not None:
            kernels.specserve_amx(int(was))
    quantized = [k for k in mods if k != "dense"]
    results = [{"rows": r, **{f"{k}_ms": round(statistics.median(samples[k, r]), 2) for k in mods},
                **{f"{k}_over_dense": round(statistics.median(samples[k, r]) / statistics.median(samples["dense", r]), 3)
                   for k in quantized}} for r in rows]
    report = {"benchmark": "quant_kernels", "machine": machine_info(torch.device("cpu")), "args": vars(args),
              "results": results}
    lines = [f"| rows | dense {args.dtype} ms/step | " + " | ".join(f"{k} ms (× dense)" for k in quantized) + " |",
             "|---" * (len(quantized) + 2) + "|"]
    lines += [f"| {r['rows']} | {r['dense_ms']} | " + " | ".join(f"{r[k + '_ms']} ({r[k + '_over_dense']}×)"
                                                          for k in quantized) + " |" for r in results]
    emit(report, args.out, "\n".join(lines))
    return report


if __name__ == "__main__":
    main()
