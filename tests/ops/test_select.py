"""Backend selection: once, logged, a setting forces the references, every op present on both sides."""

from __future__ import annotations

import dataclasses
import inspect
import logging

import torch

from deltaserve import ops


def test_cpu_selects_references_and_logs_once(caplog):
    with caplog.at_level(logging.INFO, logger="deltaserve.ops"):
        k = ops.select_kernels("cpu")
    assert set(k.backend.values()) == {"reference"}
    assert sum("ops on cpu" in r.message for r in caplog.records) == 1
    assert k.gdn_decode is ops.REFERENCE_OPS["gdn_decode"]


def test_force_reference_wins():
    k = ops.select_kernels("cuda" if torch.cuda.is_available() else "cpu", force_reference=True)
    assert set(k.backend.values()) == {"reference"}


def test_every_field_has_a_reference():
    fields = {f.name for f in dataclasses.fields(ops.Kernels)} - {"backend"}
    assert fields == set(ops.REFERENCE_OPS)


def test_triton_ops_share_the_reference_signatures():
    """Each Triton op accepts exactly its reference's parameters (plus an optional launch config)."""
    from deltaserve.ops.conv1d import triton as conv_t
    from deltaserve.ops.gdn import triton_chunk, triton_recurrent, triton_verify
    from deltaserve.ops.norm import triton as norm_t

    mods = (conv_t, triton_chunk, triton_recurrent, triton_verify, norm_t)
    for name, ref_fn in ops.REFERENCE_OPS.items():
        impls = [getattr(m, name) for m in mods if hasattr(m, name)]
        if not impls:
            continue  # attention / MoE: no Triton kernels yet
        want = [(p.name, p.kind) for p in inspect.signature(ref_fn).parameters.values()]
        got = [(p.name, p.kind) for p in inspect.signature(impls[0]).parameters.values() if p.name != "config"]
        assert got == want, f"{name}: {got} != {want}"


def test_shapes_a_triton_kernel_cannot_take_keep_the_reference():
    """Chosen at load, not discovered at call time: e.g. GDN head dim 48 (the embedded model)."""
    from deltaserve.ops import triton_registry

    shapes = {"gdn_head_k": 48, "gdn_head_v": 48, "attn_head_dim": 96}
    assert "48" in triton_registry._refusal("gdn_decode", shapes)
    assert "96" in triton_registry._refusal("paged_attention", shapes)
    assert triton_registry._refusal("causal_conv1d_fn", shapes) is None
    assert triton_registry._refusal("gdn_decode", {"gdn_head_k": 128, "gdn_head_v": 128}) is None
    # the chunked prefill only at the head dims verified on the device (64, 128): its bf16 kernels gave
    # non-finite outputs on the H200 at 16 / 32, so such a model prefills with the reference op
    small = {"gdn_head_k": 32, "gdn_head_v": 32}
    assert triton_registry._refusal("gdn_decode", small) is None
    for op in ("chunk_gated_delta_rule", "gdn_prefill"):
        assert "32" in triton_registry._refusal(op, small)
        assert triton_registry._refusal(op, {"gdn_head_k": 64, "gdn_head_v": 128}) is None
