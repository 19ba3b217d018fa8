"""Op tests: every Triton kernel against its plain-torch reference.

Without CUDA the Triton kernels run on CPU tensors through Triton's interpreter (small shapes); with
CUDA the same tests run the compiled kernels on the GPU, and the `gpu`-marked tests add real shapes.
`_interpret` must be imported before any module that defines Triton kernels.
"""

from __future__ import annotations

import pytest
import torch

from . import _interpret  # noqa: F401  (sets TRITON_INTERPRET before the kernels are decorated)

DEVICE = _interpret.DEVICE


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
