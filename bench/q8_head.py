"""The output head's products, per row count: the CPU kernels' Q8_0 product (engine/model/quantize.py Q8Head) against
the dense head in fp32 and in bf16 (torch's matmul), on the demo's head shape (49152 x 576), in one process,
interleaved repeats. Decides where Q8Head hands wide forwards to the dense head (never in fp32: the kernel is faster
at every width there, and a row's logits then never depend on its batch-mates).

`python -m bench.q8_head --rows 1,4,8,16,32,64 --repeats 9 --out docs/q8-head.json`
(`SPECSERVE_CPU_LEVEL=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` for what an AVX2 CPU runs)

Prints JSON (stdout or --out) and a markdown table (stderr). Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.output import emit
from bench.spec_decode import machine_info
from specserve.engine.model.cpu_kernels import build, ops

VOCAB, HIDDEN = 49152, 576


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.q8_head", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    lib = build.load()
    if lib is None:
        raise SystemExit("the CPU kernels could not be built here; nothing to compare")
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (VOCAB, HIDDEN), dtype=torch.int8, generator=g)
    scales = torch.rand(VOCAB, HIDDEN // ops.GROUP, generator=g) * 0.01
    dense = (codes.float().view(VOCAB, -1, ops.GROUP) * scales[..., None]).view(VOCAB, HIDDEN)
    packed, lane_scales = ops.pack_q8(codes, scales)
    lane_scales = lane_scales.view(torch.int32)
    dense_bf16 = dense.bfloat16()
    cases = {"q8_kernel": lambda x: ops.q8_linear(lib, x, packed, lane_scales),
             "dense_fp32": lambda x: torch.nn.functional.linear(x, dense),
             "dense_bf16": lambda x: torch.nn.functional.linear(x.bfloat16(), dense_bf16)}
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, HIDDEN, generator=g)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for fn in cases.values():
            fn(x)  # warm-up
        for _ in range(args.repeats):
            for name, fn in cases.items():
                t = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - t)
        ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        results.append({"rows": rows, **{f"{n}_ms": round(v, 3) for n, v in ms.items()},
                        "q8_over_fp32": round(ms["dense_fp32"] / ms["q8_kernel"], 2),
                        "q8_over_bf16": round(ms["dense_bf16"] / ms["q8_kernel"], 2)})
    report = {"benchmark": "q8_head", "machine": machine_info(torch.device("cpu")),
              "cpu_level": os.environ.get(build.ENV_LEVEL, "native"), "args": vars(args), "results": results}
    lines = ["| rows | Q8_0 kernel ms | dense fp32 ms | dense bf16 ms | fp32 / kernel | bf16 / kernel |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['q8_kernel_ms']} | {r['dense_fp32_ms']} | {r['dense_bf16_ms']} | "
              f"{r['q8_over_fp32']}x | {r['q8_over_bf16']}x |" for r in results]
    emit(report, args.out, "\n".join(lines))
    return report


if __name__ == "__main__":
    main()
