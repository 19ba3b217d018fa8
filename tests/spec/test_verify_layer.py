"""A GDN layer's verify + commit == running the accepted tokens one by one (the embedded model's first GDN
layer, fp32, reference ops): in a step that also holds a prefill chunk and a plain decode, the verify
chunks' outputs equal the per-token decode outputs, the pools stay untouched by the forward, and after
committing accepted + 1 tokens per chunk the recurrent state and conv window equal the decodes' ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltaserve import LLM
from deltaserve.batch import ForwardBatch, VerifyRecord
from deltaserve.spec.verify import commit

TOL = 1e-5


@pytest.fixture(scope="module")
def layer():
    llm = LLM(device="cpu", enforce_reference_ops=True)
    return llm.model.layers[0].linear_attn


def _batch(lens: list[int], slots: list[int], initial: list[bool], num_prefills: int, num_verifies: int = 0):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T, N = cu[-1], len(lens)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    verify = None
    if num_verifies:
        first = num_prefills - num_verifies
        vcu = [c - cu[first] for c in cu[first:num_prefills + 1]]
        verify = VerifyRecord(i32(vcu), i32(slots[first:num_prefills]))
    return ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.long), positions=torch.zeros(T, dtype=torch.long), cu_seqlens=i32(cu),
        seq_lens=i32(lens), state_slots=i32(slots), has_initial_state=torch.tensor(initial),
        slot_mapping=torch.zeros(T, dtype=torch.long), block_tables=torch.zeros(N, 1, dtype=torch.int32),
        num_prefills=num_prefills, num_prefill_tokens=cu[num_prefills], num_verifies=num_verifies,
        num_verify_tokens=0 if not num_verifies else cu[num_prefills] - cu[num_prefills - num_verifies],
        verify=verify, max_prefill_len=max(lens[:num_prefills], default=0))


def _pools(layer, slots=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ssm = torch.randn(slots, layer.nv, layer.dk, layer.dv, generator=g) * 0.1
    conv = torch.randn(slots, layer.conv_width - 1, layer.conv_dim, generator=g)
    return ssm, conv


def test_verify_then_commit_equals_decoding_the_accepted_tokens(layer):
    check_verify_commit(layer, layer.kernels)


@torch.inference_mode()
def check_verify_commit(layer, kernels, device="cpu"):
    """The step below with `kernels` doing the verify and the commit; the references with the layer's own."""
    ref_kernels = layer.kernels
    H = layer.in_proj.in_features
    g = torch.Generator().manual_seed(1)
    prefill_len, verify_lens, accepted = 5, [4, 3, 5], [1, 2, 0]    # commit accepted + 1 of each chunk
    x_pre = torch.randn(prefill_len, H, generator=g)
    x_ver = [torch.randn(n, H, generator=g) for n in verify_lens]
    x_dec = torch.randn(1, H, generator=g)
    # one step: prefill (slot 0, fresh) | verify chunks (slots 1, 2, 3) | a decode (slot 4)
    ssm, conv = _pools(layer)
    ssm0, conv0 = ssm.clone(), conv.clone()
    batch = _batch([prefill_len, *verify_lens, 1], [0, 1, 2, 3, 4], [False, True, True, True, True], 4, 3)
    layer.kernels = kernels
    try:
        out = layer(torch.cat([x_pre, *x_ver, x_dec]), batch, ssm, conv)
        assert torch.equal(ssm[1:4], ssm0[1:4]) and torch.equal(conv[1:4], conv0[1:4])   # verify left the pools
        commit(kernels, batch.verify, torch.tensor(accepted))
    finally:
        layer.kernels = ref_kernels
    # references, each on fresh copies of the starting pools
    ref_ssm, ref_conv = ssm0.clone(), conv0.clone()
    pre = layer(x_pre, _batch([prefill_len], [0], [False], 1), ref_ssm, ref_conv)
    torch.testing.assert_close(out[:prefill_len], pre, atol=TOL, rtol=TOL)
    row = prefill_len
    for n, (xs, a) in enumerate(zip(x_ver, accepted)):
        slot = 1 + n
        work_ssm, work_conv = ref_ssm.clone(), ref_conv.clone()
        for t in range(xs.shape[0]):        # every verified token, the rejected ones too (their outputs)
            dec = layer(xs[t:t + 1], _batch([1], [slot], [True], 0), work_ssm, work_conv)
            torch.testing.assert_close(out[row + t], dec[0], atol=TOL, rtol=TOL)
            if t == a:                      # the committed state: after the known token and a accepted drafts
                ref_ssm[slot], ref_conv[slot] = work_ssm[slot], work_conv[slot]
        row += xs.shape[0]
    dec = layer(x_dec, _batch([1], [4], [True], 0), ref_ssm, ref_conv)
    torch.testing.assert_close(out[row:], dec, atol=TOL, rtol=TOL)
    torch.testing.assert_close(ssm, ref_ssm, atol=TOL, rtol=TOL)
    torch.testing.assert_close(conv, ref_conv, atol=TOL, rtol=TOL)


def test_verify_record_lists_every_gdn_layer(layer):
    """The record gets one entry per GDN layer call (the runner commits each)."""
    H = layer.in_proj.in_features
    ssm, conv = _pools(layer)
    batch = _batch([3], [1], [True], 1, 1)
    with torch.inference_mode():
        layer(torch.randn(3, H), batch, ssm, conv)
        layer(torch.randn(3, H), dataclasses.replace(batch), ssm, conv)
    assert len(batch.verify.layers) == 2
