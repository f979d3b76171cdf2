"""The tensor-parallel ranks of one engine: rank 0 is the engine's own process (scheduler, proposers, verification,
and its slice of the target); ranks 1 .. N-1 are worker processes it starts (engine/parallel/worker.py), each with
its slice of the target and its heads' KV pool. They join one torch.distributed group (gloo on CPU, NCCL on CUDA)
for the all-reduces inside the forward. Commands travel beside it, on one pipe per worker: every step rank 0 sends
what the workers replay (a forward's inputs, a K/V move, a block copy, stop). Not a collective on purpose: a worker
waits for its next command as long as the server is idle, and a collective would time out (gloo's wait is bounded);
the group's timeout (COLLECTIVE_TIMEOUT) then bounds only the waits inside a forward.

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

JOIN_TIMEOUT = timedelta(seconds=120)  # a spawned worker says it is alive (imports done) within this
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # the rendezvous, and any wait for a peer inside a forward
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
    timeout_s: float = COLLECTIVE_TIMEOUT.total_seconds()  # the group's wait for a peer inside a forward


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_group(spec: WorkerSpec, store) -> None:
    """Join the default group, whose collectives are the forward's all-reduces."""
    import torch.distributed as dist

    dist.init_process_group(backend(spec.device_type), store=store, rank=spec.rank, world_size=spec.world,
                            timeout=timedelta(seconds=spec.timeout_s))


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
        self._await("alive", JOIN_TIMEOUT.total_seconds(), watch=False)  # each worker joins right after
        try:
            init_group(spec, self._store)
        except Exception as exc:
            self.kill()
            raise RuntimeError(f"tensor_parallel_size: the ranks did not join ({self._exits() or exc})") from exc

    # -- start-up -----------------------------------------------------------------------------------------------

    def wait_ready(self) -> None:
        """Block until every worker has loaded and split its model; raise the first worker error, rank named."""
        self._await("ready", LOAD_TIMEOUT, watch=True)

    def _await(self, expected: str, timeout: float, watch: bool) -> None:
        """One message from every worker: `expected`, or ("error", message), or its death, all raised with the rank
        named; then, with `watch`, the watchdog starts."""
        pending = dict(zip(self.pipes, range(1, self.spec.world)))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, start=1)}
        while pending:
            ready = wait([*pending, *sentinels], timeout=timeout)
            if not ready:
                self.kill()
                raise RuntimeError(f"tensor_parallel_size: ranks {sorted(pending.values())} did not get {expected} "
                                   f"within {timeout:.0f} s")
            for r in ready:
                if r in pending:
                    try:
                        kind, message = r.recv()
                    except EOFError:
                        kind, message = "error", "its pipe closed"
                    if kind == "error":
                        self._fail_start(pending[r], message)
                    del pending[r]
                elif r in sentinels and sentinels[r] in pending.values():
                    self._fail_start(sentinels[r], f"exited with code {self.procs[sentinels[r] - 1].exitcode}")
        if watch:
            threading.Thread(target=self._watch, name="specserve-tp-watchdog", daemon=True).start()

    def _fail_start(self, rank: int, message: str):
        self.kill()
        raise RuntimeError(f"tensor_parallel_size: rank {rank} failed to start: {message}")

    # -- commands -------------------------------------------------------------------------------------------------

    def send(self, *command) -> None:
        """One command to every worker (they replay them in order); plain Python values only (no tensors: torch's
        multiprocessing pickler would move them through shared memory)."""
        try:
            for pipe in self.pipes:
                pipe.send(command)
        except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
            if not self._closing:  # closing (or killed): a worker already gone is no failure
                self.fatal(f"a worker stopped reading commands ({type(exc).__name__})")

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
