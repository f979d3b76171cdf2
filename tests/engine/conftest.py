"""Fixtures shared by the engine tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is many times faster than two contending ones (use via pytest.mark.usefixtures)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _kernel_levels() -> list[str]:
    from specserve.engine.model.cpu_kernels import build

    return build.runnable_levels() if build.compiler() else []


@pytest.fixture(params=_kernel_levels())
def kernel_level(request, monkeypatch):
    """The engine built on the CPU kernels of each level this CPU executes (portable C, x86-64-v3, v4, ..., native),
    not only its own: SPECSERVE_CPU_LEVEL for the engines the test makes."""
    from specserve.engine.model.cpu_kernels import build

    monkeypatch.setenv(build.ENV_LEVEL, request.param)
    build.load.cache_clear()
    yield request.param
    build.load.cache_clear()
