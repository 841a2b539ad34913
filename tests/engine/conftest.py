"""Fixtures the engine tests share."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread for a module (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`).

    Tiny models gain nothing from threads, and on a shared 2-core box OpenMP threads that
    spin-wait against other processes make these tests ~8x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
