"""A tensor-parallel worker (ranks 1 .. N-1): loads the target, keeps its slice, holds its heads' KV pool, and replays
rank 0's commands until told to stop. It never schedules, proposes or samples; its logits are not computed (rank 0
has the same ones, the residual stream being whole on every rank)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from specserve.engine.parallel.group import WorkerSpec, init_group, rank_device

log = logging.getLogger("specserve.engine.parallel")


def worker_main(spec: WorkerSpec, conn) -> None:
    """Process entry point (spawned by TensorParallelGroup)."""
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s tp-rank{spec.rank} %(name)s: %(message)s")
    torch.set_num_threads(spec.threads)
    _exit_with_parent()
    import torch.distributed as dist

    conn.send(("alive", None))
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world, is_master=False)
    init_group(spec, store)
    try:
        model, kv_heads = load_shard(spec)
    except Exception as exc:  # noqa: BLE001  reported to rank 0, which raises it with the rank named
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    conn.send(("ready", None))
    try:
        serve(spec, model, kv_heads, conn)
    except Exception:
        log.exception("tensor parallel rank %d failed", spec.rank)
        os._exit(1)
    dist.destroy_process_group()


def load_shard(spec: WorkerSpec):
    """-> (the model cut to this rank's slice with its all-reduces attached, this rank's K/V heads)."""
    import torch.distributed as dist

    from specserve.engine.model.loader import load_model
    from specserve.engine.parallel.shard import attach_all_reduce, local_kv_heads, shard_model

    device = rank_device(spec.device_type, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rowwise: list[str] = []
    model = load_model(spec.model, spec.dtype, device, spec.trust_remote_code, quantization=spec.quantization,
                       dense_from_rows=spec.dense_from_rows,
                       shard=lambda m: rowwise.extend(shard_model(m, spec.rank, spec.world, shard_unit(spec))))
    attach_all_reduce(model, rowwise, dist.group.WORLD)
    return model, local_kv_heads(model.config, spec.world)[spec.rank]


def shard_unit(spec: WorkerSpec) -> int:
    """MLP features are split in runs that keep int4's groups of 32 whole."""
    from specserve.engine.model.quantize import INT4_GROUP

    return INT4_GROUP if spec.quantization == "int4" else 1


@torch.inference_mode()
def serve(spec: WorkerSpec, model, kv_heads: int, conn) -> None:
    """Replay rank 0's commands until "stop" (or rank 0's end of the pipe closes)."""
    from specserve.engine.model.runner import ModelRunner
    from specserve.engine.sched.kv_cache import KVPool

    device = rank_device(spec.device_type, spec.rank)
    runner = None
    no_logits = torch.empty(0, dtype=torch.long)
    while True:
        try:
            op, *args = conn.recv()
        except EOFError:  # rank 0 is gone
            os._exit(1)
        if op == "kv":
            num_blocks, block_size = args
            kv = KVPool.allocate(model.config, num_blocks, block_size, spec.dtype, device, kv_heads=kv_heads)
            runner = ModelRunner(model, kv, device, model.config.vocab_size)
        elif op == "run":
            input_ids, chunks = args
            runner.run(torch.tensor(input_ids, dtype=torch.long), chunks, no_logits)
        elif op == "copy_slots":
            runner.kv.copy_slots(*args)
        elif op == "copy_blocks":
            runner.kv.copy_blocks(*args)
        elif op == "stop":
            return
        else:
            raise RuntimeError(f"unknown command {op!r}")


def _exit_with_parent() -> None:
    """Rank 0 gone (killed, crashed): this worker has nobody to serve."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="specserve-tp-parent", daemon=True).start()
