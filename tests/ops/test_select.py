"""Backend selection: once, logged at DEBUG with a one-line summary, a setting forces the references, every op
present on both sides, the fold rules set from the kernels chosen, the decode-graph backend."""

from __future__ import annotations

import dataclasses
import inspect
import logging

import torch

from deltaserve import ops


def test_cpu_selects_references_and_logs_once_at_debug(caplog):
    with caplog.at_level(logging.INFO, logger="deltaserve.ops"):
        ops.select_kernels("cpu")
    assert not caplog.records, "nothing at INFO"
    with caplog.at_level(logging.DEBUG, logger="deltaserve.ops"):
        k = ops.select_kernels("cpu")
    assert set(k.backend.values()) == {"reference"}
    assert sum("ops on cpu" in r.message for r in caplog.records) == 1
    assert k.gdn_decode is ops.REFERENCE_OPS["gdn_decode"]
    assert k.summary() == f"reference ({len(ops.REFERENCE_OPS)} ops)"
    assert k.conv_fold_rows == (0, 0) and k.gate_fold_rows == 0, "the references fold nothing"


def test_refused_kernels_warn_once_per_reason_and_show_in_the_summary(monkeypatch, caplog):
    """A device whose Triton registry refuses some ops (faked here): one warning per reason naming the ops,
    the summary counts each backend and says why, and the fold rules come from the registry."""
    names = sorted(ops.REFERENCE_OPS)
    refused = {"chunk_gated_delta_rule": "needs 64", "gdn_prefill": "needs 64", "paged_attention": "needs 96"}
    usable = {n: ops.REFERENCE_OPS[n] for n in names if n not in refused}
    rules = {"conv_fold_rows": (1, 8), "gate_fold_rows": 1}
    monkeypatch.setattr(ops, "_triton_ops", lambda device, shapes: (usable, refused, rules))
    with caplog.at_level(logging.WARNING, logger="deltaserve.ops"):
        k = ops.select_kernels("cuda")
    assert [r.message for r in caplog.records] == [
        "chunk_gated_delta_rule, gdn_prefill on cuda: torch reference (needs 64)",
        "paged_attention on cuda: torch reference (needs 96)"]
    assert k.summary() == (f"triton {len(usable)}, reference 3 (chunk_gated_delta_rule, gdn_prefill: needs 64; "
                           "paged_attention: needs 96)")
    assert (k.conv_fold_rows, k.gate_fold_rows) == ((1, 8), 1)
    assert ops.select_kernels("cuda", force_reference=True).conv_fold_rows == (0, 0)


def test_fold_rules_come_from_the_kernels_they_tune():
    from deltaserve.ops import triton_registry
    from deltaserve.ops.linear import triton as linear_triton

    everything = triton_registry._all_ops()
    assert triton_registry.fold_rules(everything) == {"conv_fold_rows": linear_triton.CONV_FOLD_ROWS,
                                                      "gate_fold_rows": linear_triton.GATE_FOLD_MAX_ROWS}
    assert triton_registry.fold_rules({}) == {}


def test_decode_graph_backend_replaces_its_ops_only():
    from deltaserve.ops import decode_graph

    k = ops.select_kernels("cpu", decode_graph_ops=True)
    for name, fn in ops.REFERENCE_OPS.items():
        want = decode_graph.OPS.get(name, fn)
        assert getattr(k, name) is want and k.backend[name] == ("decode-graph" if name in decode_graph.OPS
                                                                else "reference"), name
    assert set(k.summary().split(", ")) == {f"reference {len(ops.REFERENCE_OPS) - len(decode_graph.OPS)}",
                                            f"decode-graph {len(decode_graph.OPS)}"}
    try:
        ops.select_kernels("cuda", decode_graph_ops=True)
    except ValueError as exc:
        assert "compiled CPU decode step" in str(exc)
    else:
        raise AssertionError("decode-graph ops off CPU")


def test_force_reference_wins():
    k = ops.select_kernels("cuda" if torch.cuda.is_available() else "cpu", force_reference=True)
    assert set(k.backend.values()) == {"reference"}


def test_every_field_has_a_reference():
    rules = {"backend", "conv_fold_rows", "gate_fold_rows", "kept_reference", "fp8_path"}
    fields = {f.name for f in dataclasses.fields(ops.Kernels)} - rules
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
