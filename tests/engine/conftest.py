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
