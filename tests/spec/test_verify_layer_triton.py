"""The GDN layer's verify + commit with the Triton gdn_verify / gdn_commit kernels (Triton's interpreter on
CPU, compiled on a GPU) == decoding the accepted tokens one by one with the references: the layer hands the
kernels its split views of the input projection as they are."""

from __future__ import annotations

from tests.ops import _interpret  # noqa: F401, I001  (sets TRITON_INTERPRET before any Triton kernel module is imported)

import dataclasses

import pytest

from deltaserve import LLM
from tests.conftest import TinySpec
from tests.spec.test_verify_layer import check_verify_commit


@pytest.fixture(scope="module")
def layer(tiny_model):
    llm = LLM(tiny_model(TinySpec(family="qwen3_5", ratio=2, seed=3)), device="cpu", enforce_reference_ops=True)
    return llm.model.layers[0].linear_attn


def test_triton_verify_then_commit_equals_decoding_the_accepted_tokens(layer):
    from deltaserve.ops.gdn import triton_verify as tv

    kernels = dataclasses.replace(layer.kernels, gdn_verify=tv.gdn_verify, gdn_commit=tv.gdn_commit)
    check_verify_commit(layer, kernels)
