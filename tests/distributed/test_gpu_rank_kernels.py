"""The GDN kernels at the per-rank head counts tensor parallelism gives (key heads / tp, value heads / tp): the
same device-vs-reference checks as tests/ops/test_gdn_heads_gpu.py, at Qwen3-Next's 16 / 32 over tp 2, 4, 8,
Qwen3.5-397B's 16 / 64 and 27B's 16 / 48 over tp 8, and the small Qwen3.5 models' 16 / 16 over tp 8. The head
count changes which chain the dispatcher picks (ops/gdn/dispatch.py), so each rank's shape is checked on the
device. Skipped without CUDA."""

from __future__ import annotations

import pytest

from tests.conftest import gpu
from tests.ops import test_gdn_heads_gpu as heads

pytestmark = [pytest.mark.gpu, gpu]

PER_RANK = [(8, 16), (4, 8), (2, 4), (2, 8), (2, 6), (2, 2), (1, 2), (1, 1)]   # (key heads, value heads) a rank


@pytest.mark.parametrize("hk,hv", PER_RANK)
@pytest.mark.parametrize("lengths", [[1, 63, 64, 65, 1000, 300]], ids=["mixed"])
def test_chunk_at_rank_heads(hk, hv, lengths):
    heads.test_chunk_heads(hk, hv, lengths)


@pytest.mark.parametrize("hk,hv", PER_RANK)
@pytest.mark.parametrize("B", [1, 40])
def test_decode_verify_commit_at_rank_heads(hk, hv, B):
    heads.test_decode_verify_commit_heads(hk, hv, B)
