"""Fixtures shared by the unit and integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def torch_one_thread():
    """Run a module's tiny models on one torch thread: on the shared 2-core test machine a second thread only
    adds contention (tiny-model training went from ~1 s to ~20 s on a loaded box). Use it with
    ``pytestmark = pytest.mark.usefixtures("torch_one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
