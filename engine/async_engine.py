"""AsyncEngine: runs EngineCore's step loop on a dedicated thread (torch releases the GIL) and streams each
request's outputs to its asyncio consumer. Requests join and leave between steps (continuous batching)."""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from copy import deepcopy
from dataclasses import replace

from specserve.config.schema import EngineConfig
from specserve.engine.client import EngineHealth, EngineSnapshot
from specserve.engine.core import EngineCore
from specserve.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from specserve.engine.request import RequestOutput
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.stats import EngineTotals, StepStats
from specserve.engine.tokens import encode_prompt, encode_rendered

StepCallback = Callable[[StepStats, list[RequestOutput]], None]


class AsyncEngine:
    """The EngineClient (engine/client.py) the server talks to."""

    def __init__(self, config: EngineConfig, on_step: StepCallback | None = None):
        self.config = config
        self.on_step = on_step  # called on the engine thread after every step (metrics)
        self.core: EngineCore | None = None
        self._state, self._error = "loading", None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._submitted = 0  # adds put in the inbox; minus _drained = adds the engine thread has not seen yet
        self._drained = 0
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.tokenizer = None  # a copy for the event loop's thread: HF fast tokenizers are not safe to share
        self.max_model_len: int | None = None
        self.kv_cache_blocks: tuple[int, int] | None = None  # (block size in tokens, number of blocks), once loaded

    # -- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread, which loads the models (off the event loop: the server is already listening)
        and then runs the step loop.

        Loading and stepping share one thread on purpose: a thread that has run torch's parallel (OpenMP) work and
        stays alive slowed every later parallel region on another thread ~1.5-2.5x on the 2-core EPYC (batch-16
        decode step 140-250 ms vs 70-105 ms; loading in asyncio.to_thread did exactly that)."""
        self._loop = asyncio.get_running_loop()
        loaded = self._loop.create_future()
        self._thread = threading.Thread(target=self._main, args=(loaded,), name="specserve-engine", daemon=True)
        self._thread.start()
        try:
            await loaded
            self.tokenizer = copy.deepcopy(self.core.tokenizer)
            self.max_model_len = self.core.max_model_len
            self.kv_cache_blocks = (self.core.allocator.block_size, self.core.allocator.num_blocks)
        except Exception as exc:  # a bad model path must not kill the server: /health reports it
            self._state, self._error = "dead", f"model loading failed: {exc}"
            raise
        self._state = "ready"

    async def shutdown(self) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if self.core is not None:
            self.core.close()
        if self._state == "ready":
            self._state = "stopped"
        self._fail_all(EngineDeadError("the engine has stopped"))

    def health(self) -> EngineHealth:
        return EngineHealth(self._state, self._error)

    def stats(self) -> EngineSnapshot:
        core = self.core
        if core is None:
            return EngineSnapshot(EngineTotals(), StepStats(), 0, 0, 0.0)
        return EngineSnapshot(deepcopy(core.totals), core.last_step, len(core.scheduler.running),
                              len(core.scheduler.waiting) + self._submitted - self._drained, core.allocator.usage)

    # -- requests -----------------------------------------------------------------------------------------------

    def submit(self, prompt: str | list[int], params: SamplingParams,
               request_id: str | None = None) -> "RequestStream":
        """Validate and enqueue now (raises InvalidRequestError / QueueFullError / EngineDeadError at once);
        the returned stream yields the request's outputs. Closing it early aborts the request."""
        if self._state != "ready" or self.core is None:
            raise EngineDeadError(self._error or f"the engine is {self._state}")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:  # this thread's own map of streams; the core checks its requests again
            raise InvalidRequestError(f"request_id {request_id!r} is already running", "request_id")
        ids = encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str) else prompt
        if isinstance(params.prediction, str):  # tokenised here: the engine thread's tokenizer is not ours
            params = replace(params, prediction=encode_rendered(self.tokenizer, params.prediction))
        request = self.core.make_request(request_id, prompt, params, ids)
        waiting = len(self.core.scheduler.waiting) + self._submitted - self._drained
        if waiting >= self.config.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_queue_len} requests)")
        stream = RequestStream(self, request)
        self._streams[request_id] = stream
        self._submitted += 1
        self._inbox.put(("add", request))
        self._wakeup.set()
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = self.submit(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def _close_stream(self, request_id: str, finished: bool) -> None:
        self._streams.pop(request_id, None)
        if not finished:  # consumer went away (client disconnect) or an error: free the KV at once
            self._inbox.put(("abort", request_id))
            self._wakeup.set()

    def fail_all(self, message: str) -> None:
        """End every in-flight request with an error (graceful-shutdown deadline); their KV is freed."""
        self._fail_all(EngineDeadError(message))

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    # -- engine thread ------------------------------------------------------------------------------------------

    def _main(self, loaded: asyncio.Future) -> None:
        try:
            self.core = EngineCore(self.config)
        except BaseException as exc:
            self._loop.call_soon_threadsafe(_settle, loaded, exc)
            return
        self._loop.call_soon_threadsafe(_settle, loaded, None)
        self._run()

    def _run(self) -> None:
        core = self.core
        while not self._stop.is_set():
            aborted = self._drain_inbox()
            if aborted:
                self._publish(aborted)
                if self.on_step is not None:  # gauges must drop even if no step follows the abort
                    self.on_step(StepStats(num_running=len(core.scheduler.running),
                                           num_waiting=len(core.scheduler.waiting),
                                           kv_cache_usage=core.allocator.usage), aborted)
            if not core.has_unfinished():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = core.step()
                if self.on_step is not None:
                    self.on_step(core.last_step, outputs)
            except Exception as exc:  # fatal: report on /health, fail every request, stop stepping
                self._state, self._error = "dead", f"engine step failed: {exc!r}"
                self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(self._error))
                return
            self._publish(outputs)

    def _drain_inbox(self) -> list[RequestOutput]:
        aborted = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return aborted
            if kind == "add":
                self._drained += 1
                self.core.add_request(item)
            else:
                out = self.core.abort(item)
                if out is not None:
                    aborted.append(out)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _fail_all(self, exc: Exception) -> None:
        for stream in self._streams.values():
            stream.put(exc)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():  # start() may have been cancelled meanwhile
        future.set_exception(error) if error is not None else future.set_result(None)


class RequestStream:
    """Async iterator over one request's outputs; `aclose()` before the end aborts the request.

    Backpressure: at most one undelivered output is held. If the consumer (a slow SSE reader) falls behind,
    newer outputs are merged into it (deltas concatenated, snapshot fields replaced), so memory per request stays
    bounded by one snapshot however far behind the reader is.
    """

    def __init__(self, engine: AsyncEngine, request):
        self.engine = engine
        self.request_id = request.request_id
        self.num_prompt_tokens = request.num_prompt_tokens
        self.finished = False
        self._pending: RequestOutput | Exception | None = None
        self._ready = asyncio.Event()
        self._closed = False

    def put(self, item: RequestOutput | Exception) -> None:
        """On the event loop: hand over an output (merged into an undelivered one) or an error."""
        prev = self._pending
        if isinstance(item, RequestOutput) and isinstance(prev, RequestOutput):
            item = replace(item, delta_text=prev.delta_text + item.delta_text,
                           delta_token_ids=prev.delta_token_ids + item.delta_token_ids,
                           delta_logprobs=None if item.delta_logprobs is None else
                           (prev.delta_logprobs or []) + item.delta_logprobs)
        elif isinstance(prev, Exception):
            return  # an error is final
        self._pending = item
        self._ready.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        await self._ready.wait()
        item, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(item, Exception):
            await self.aclose()
            raise item
        self.finished = item.finished
        return item

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine._close_stream(self.request_id, self.finished)
