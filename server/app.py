"""FastAPI application factory: the engine lives on app.state; models load after the server starts listening."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from sse_starlette.sse import AppStatus

from specserve.config.schema import AppConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.model.loader import DEMO_MODEL_NAME, is_gguf
from specserve.engine.spec_decode.prediction import MAX_K as PREDICTION_K
from specserve.engine.spec_decode.registry import canonical
from specserve.server.auth import resolve_api_keys
from specserve.server.errors import BodyLimitMiddleware, install_error_handlers
from specserve.server.metrics import Metrics
from specserve.server.request_log import RequestIdMiddleware
from specserve.server.response_store import ResponseStore
from specserve.server.routes import router
from specserve.server.serving import ServingContext
from specserve.server.tools import PARSERS

log = logging.getLogger("specserve")


def package_version() -> str:
    try:
        return version("specserve")
    except PackageNotFoundError:
        return "0.0.0+source"


def served_model_name(config: AppConfig) -> str:
    if config.server.served_model_name:
        return config.server.served_model_name
    if not config.engine.model:
        return DEMO_MODEL_NAME
    path = Path(config.engine.model)
    return path.stem if is_gguf(path) else path.name


async def _load(engine: AsyncEngine, metrics: Metrics) -> None:
    try:
        await engine.start()
        metrics.set_cache_config(*engine.kv_cache_blocks)
        log.info("engine ready")
    except Exception as exc:  # reported by /health (503) rather than crashing the server
        log.error("engine failed to start: %s", exc)


def create_app(config: AppConfig) -> FastAPI:
    name = served_model_name(config)
    ks = [m.k_max for m in config.engine.speculative_methods] + [PREDICTION_K]
    metrics = Metrics(name, canonical(config.engine.method), max(ks))
    engine = AsyncEngine(config.engine, on_step=metrics.on_step)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # we drain streams ourselves on SIGTERM (up to --shutdown-timeout) instead of sse-starlette ending them
        AppStatus.disable_automatic_graceful_drain()
        app.state.loop = asyncio.get_running_loop()
        loading = asyncio.create_task(_load(engine, metrics))
        yield
        loading.cancel()
        await engine.shutdown()

    app = FastAPI(title="specserve", version=package_version(), lifespan=lifespan,
                  description="OpenAI-compatible inference with lossless speculative decoding")
    app.state.config = config
    app.state.api_keys = resolve_api_keys(config.server.api_key, config.server.api_key_file)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.ctx = ServingContext(engine=engine, model_name=name, request_timeout=config.server.request_timeout,
                                   tool_parser=PARSERS[config.server.tool_call_parser])
    app.state.draining = False
    app.state.responses = ResponseStore(config.server.responses_store_max_entries,
                                        config.server.responses_store_max_age)
    install_error_handlers(app)
    app.include_router(router)
    if config.server.cors_allow_origins:
        origins = [o.strip() for o in config.server.cors_allow_origins.split(",") if o.strip()]
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.server.max_request_bytes)
    app.add_middleware(RequestIdMiddleware)
    return app


def begin_drain(app: FastAPI) -> None:
    """SIGTERM: stop admitting; in-flight requests may finish for shutdown_timeout seconds, then end with an error."""
    if app.state.draining:
        return
    app.state.draining = True
    loop = getattr(app.state, "loop", None)
    if loop is not None:
        timeout = app.state.config.server.shutdown_timeout
        loop.call_soon_threadsafe(loop.call_later, timeout, app.state.engine.fail_all,
                                  "the server is shutting down")
