"""Tensor parallelism against one device, offline (LLM.generate): tokens/s at each concurrency for
`--tensor-parallel-size 1` and N, each engine in its own process after the other, plus what one all-reduce of a
hidden-state row costs on this machine's group (the per-layer price a sharded draft would pay too).

`python -m bench.tensor_parallel --sizes 1,2 --concurrency 1,4 --out docs/tensor-parallel.json`
(defaults: the demo target, plain decoding; `--speculative-method eagle3` adds the demo drafter on rank 0;
`--device cuda` on a multi-GPU machine). Greedy, `ignore_eos`, held-out chat questions. Nothing else should run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench.output import emit


def measure(size: int, args) -> dict:
    from bench.adaptive import batches
    from bench.prompts import heldout_prompts
    from specserve.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, speculative_method=args.speculative_method, device=args.device, dtype=args.dtype,
              quantization=args.quantization, tensor_parallel_size=size)
    start = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        work = batches(heldout_prompts(), c, at_least=2 * c)
        llm.generate(work[0], params)  # untimed warm-up at this level
        t = time.perf_counter()
        outs = [o for batch in work[1:] for o in llm.generate(batch, params)]
        seconds = time.perf_counter() - t
        rows.append({"concurrency": c, "tokens_per_s": sum(len(o.output_token_ids) for o in outs) / seconds,
                     "texts_digest": hash(tuple(tuple(o.output_token_ids) for o in outs)) & 0xFFFFFFFF})
    hidden = llm.engine.target.model.config.hidden_size
    llm.close()
    return {"tensor_parallel_size": size, "start_seconds": start, "hidden_size": hidden, "rows": rows}


def allreduce_us(hidden: int, world: int, rows: int, repeats: int = 300) -> float:
    """Microseconds per all-reduce of a [rows, hidden] bf16 tensor over `world` fresh gloo ranks on this machine
    (what every attention block and MLP of a sharded model pays, twice per layer)."""
    import torch.multiprocessing as mp

    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world, hidden, rows, repeats, queue, port))
             for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
    return result


def _allreduce_rank(rank, world, hidden, rows, repeats, queue, port) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(rows, hidden, dtype=torch.bfloat16)
    for _ in range(20):
        dist.all_reduce(x)
    dist.barrier()
    t = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(x)
    if rank == 0:
        queue.put((time.perf_counter() - t) / repeats * 1e6)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tensor_parallel", description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--speculative-method", default="none")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args)))
        return 0
    runs = []
    for size in (int(s) for s in args.sizes.split(",")):
        cmd = [sys.executable, "-m", "bench.tensor_parallel", "--worker", str(size), "--device", args.device,
               "--dtype", args.dtype, "--quantization", args.quantization, "--concurrency", args.concurrency,
               "--max-tokens", str(args.max_tokens), "--speculative-method", args.speculative_method,
               *(["--model", args.model] if args.model else [])]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    from bench.spec_decode import machine_info
    import torch

    sizes = [r["tensor_parallel_size"] for r in runs]
    allreduce = {f"rows_{rows}": allreduce_us(runs[0]["hidden_size"], max(sizes), rows) for rows in (1, 16)} \
        if args.device == "cpu" and max(sizes) > 1 else None
    base = runs[0]
    lines = ["| streams | " + " | ".join(f"TP={r['tensor_parallel_size']} tokens/s" for r in runs)
             + " | " + " | ".join(f"TP={r['tensor_parallel_size']} / TP={base['tensor_parallel_size']}"
                                  for r in runs[1:]) + " | same tokens |",
             "|---" * (2 * len(runs)) + "|---|"]
    for i, row in enumerate(base["rows"]):
        cells = [f"{r['rows'][i]['tokens_per_s']:.1f}" for r in runs]
        ratios = [f"{r['rows'][i]['tokens_per_s'] / row['tokens_per_s']:.2f}x" for r in runs[1:]]
        same = all(r["rows"][i]["texts_digest"] == row["texts_digest"] for r in runs)
        lines.append(f"| {row['concurrency']} | " + " | ".join(cells + ratios) + f" | {same} |")
    lines.append("start-up: " + ", ".join(f"TP={r['tensor_parallel_size']} {r['start_seconds']:.0f} s" for r in runs))
    if allreduce:
        lines.append(f"one gloo all-reduce over {max(sizes)} ranks: " + ", ".join(
            f"{k.split('_')[1]} rows {v:.0f} us" for k, v in allreduce.items()))
    report = {k: getattr(args, k) for k in ("model", "speculative_method", "device", "dtype", "quantization",
                                           "max_tokens")} | {"runs": runs, "allreduce_us": allreduce,
                                                             "machine": machine_info(torch.device(args.device))}
    emit(report, args.out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
