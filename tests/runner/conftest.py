from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """Tiny models run fastest on one thread, and intra-op threads collapse on a shared, oversubscribed CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
