"""The tensor-parallel ranks of one engine: rank 0 is the engine's own process (scheduler, proposers, verification,
and its slice of the target); ranks 1 .. N-1 are worker processes it starts (engine/parallel/worker.py), each with
its slice of the target and its heads' KV pool. They join one torch.distributed group (gloo on CPU, NCCL on CUDA,
with a gloo group beside it for commands), and every step rank 0 broadcasts what the workers replay: a forward's
inputs, a K/V move, or stop.

Failure is never a hang: a watchdog thread on rank 0 waits on the workers' process sentinels, and when one exits
while the engine runs it logs which rank died and how, and ends the process with status 1 (a supervisor such as
Kubernetes restarts it); a worker whose rank 0 is gone exits too. Start-up errors on a worker (a model it cannot
load or split) come back through a pipe and are raised on rank 0 with the rank named.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import wait

import torch

log = logging.getLogger("specserve.engine.parallel")

JOIN_TIMEOUT = timedelta(seconds=120)  # rendezvous of the ranks (the models load after it)
LOAD_TIMEOUT = 3600.0  # seconds a worker may take to load and split its model
EXIT_STATUS = 1


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to load its slice, picklable: the resolved choices of rank 0's config."""

    model: str
    dtype: torch.dtype
    device_type: str  # cpu | cuda (rank r uses cuda:r)
    trust_remote_code: bool
    quantization: str | None
    dense_from_rows: int
    world: int
    store_port: int = 0
    rank: int = 0
    threads: int = 1
    log_level: int = logging.INFO


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_group(spec: WorkerSpec, store):
    """Join the default group; -> the group commands travel on (gloo: objects are pickled on the CPU)."""
    import torch.distributed as dist

    dist.init_process_group(backend(spec.device_type), store=store, rank=spec.rank, world_size=spec.world,
                            timeout=JOIN_TIMEOUT if spec.device_type == "cpu" else None)
    return dist.new_group(backend="gloo") if spec.device_type == "cuda" else dist.group.WORLD


class TensorParallelGroup:
    """Rank 0's side: the workers, the command channel and the watchdog."""

    def __init__(self, spec: WorkerSpec):
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("tensor_parallel_size: this process already has a torch.distributed group; the "
                               "engine starts its own ranks (run it without torchrun)")
        self.spec = spec
        self._closing = False
        self._fatal = threading.Lock()
        self._store = dist.TCPStore("127.0.0.1", 0, spec.world, is_master=True, wait_for_workers=False,
                                    timeout=JOIN_TIMEOUT)
        spec = replace(spec, store_port=self._store.port)
        ctx = multiprocessing.get_context("spawn")
        from specserve.engine.parallel.worker import worker_main

        self.procs, self.pipes = [], []
        for rank in range(1, spec.world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(replace(spec, rank=rank), theirs),
                               name=f"specserve-tp-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.pipes.append(ours)
        log.info("tensor parallel: %d ranks, workers %s", spec.world,
                 ", ".join(f"rank {i + 1} pid {p.pid}" for i, p in enumerate(self.procs)))
        try:
            self.commands = init_group(spec, self._store)
        except Exception as exc:
            self.kill()
            raise RuntimeError(f"tensor_parallel_size: the ranks did not join ({self._exits() or exc})") from exc

    # -- start-up -----------------------------------------------------------------------------------------------

    def wait_ready(self) -> None:
        """Block until every worker has loaded and split its model; raise the first worker error, rank named."""
        pending = dict(zip(self.pipes, range(1, self.spec.world)))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, start=1)}
        while pending:
            ready = wait([*pending, *sentinels], timeout=LOAD_TIMEOUT)
            if not ready:
                self.kill()
                raise RuntimeError(f"tensor_parallel_size: ranks {sorted(pending.values())} did not load their "
                                   f"model within {LOAD_TIMEOUT:.0f} s")
            for r in ready:
                if r in sentinels and sentinels[r] in pending.values():
                    self._fail_start(sentinels[r], f"exited with code {self.procs[sentinels[r] - 1].exitcode}")
                if r in pending:
                    kind, message = r.recv()
                    if kind == "error":
                        self._fail_start(pending[r], message)
                    del pending[r]
        threading.Thread(target=self._watch, name="specserve-tp-watchdog", daemon=True).start()

    def _fail_start(self, rank: int, message: str):
        self.kill()
        raise RuntimeError(f"tensor_parallel_size: rank {rank} failed to start: {message}")

    # -- commands -------------------------------------------------------------------------------------------------

    def send(self, *command) -> None:
        """Broadcast one command to the workers (they replay it in order)."""
        import torch.distributed as dist

        dist.broadcast_object_list([command], src=0, group=self.commands)

    def fatal(self, reason: str) -> None:
        """The ranks can no longer agree (a worker died, a collective failed, rank 0 failed inside one): log which
        rank died if one did (a failed collective is usually its echo), end the workers, end the process."""
        with self._fatal:  # the watchdog and the engine thread may both get here; the first one exits
            gone = wait([p.sentinel for p in self.procs], timeout=2.0)  # a dead peer is the cause worth naming
            for p in self.procs:
                if p.sentinel in gone:
                    p.join(timeout=2.0)  # its pipe closes a moment before its exit status can be read
            dead = [f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                    for rank, p in enumerate(self.procs, start=1) if p.sentinel in gone]
            cause = "; ".join(dead) + " while serving, and the other ranks cannot go on without its share of the " \
                "model" if dead else reason
            log.critical("tensor parallel: %s; exiting with status %d", cause, EXIT_STATUS)
            if dead:
                log.info("tensor parallel: rank 0 saw: %s", reason)
            self.kill()
            logging.shutdown()
            os._exit(EXIT_STATUS)

    def _watch(self) -> None:
        wait([p.sentinel for p in self.procs])
        if not self._closing:
            self.fatal("a worker exited")

    # -- shutdown -------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers and leave the group (the process may start another engine afterwards)."""
        import torch.distributed as dist

        if self._closing:
            return
        self._closing = True
        try:
            self.send("stop")
        except Exception:  # noqa: BLE001  a worker already gone: kill the rest below
            pass
        for p in self.procs:
            p.join(timeout=10)
        self.kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    def kill(self) -> None:
        self._closing = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def _exits(self) -> str:
        gone = [f"rank {rank} exited with code {p.exitcode}" for rank, p in enumerate(self.procs, start=1)
                if p.exitcode is not None]
        return "; ".join(gone)
