"""The GDN kernels on a CUDA device at the head counts of published checkpoints besides Qwen3-Next's 16 key /
32 value heads (test_gpu.py's shape): 16 / 16 (the small Qwen3.5 models), 16 / 48 (Qwen3.5-27B), 16 / 64, plus
ratios 2 and 4 at 16 value heads and a count the Gluon chain does not take (24: the Triton chain). Each op's
default configuration on the device against the fp32 reference on the same bf16 inputs; skipped without CUDA.

At 16 value heads a 64-byte TMA box of the chunk decays once put every second ring stage of the Gluon chain off the
128-byte alignment TMA needs ("misaligned address" on the H200); nothing at 32 heads showed it."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.gdn import reference as ref

from .helpers import assert_close, cu_seqlens, gen, rel_err
from .test_gpu import D, TOL_BF16, _inputs, _report

pytestmark = pytest.mark.gpu

HEADS = [(16, 16), (8, 16), (4, 16), (16, 48), (16, 64), (8, 24)]  # (key heads, value heads)


def _prefill_case(lengths, hk, hv, seed):
    q, k, v, g, beta = _inputs(lengths, hk, hv, seed=seed)
    N = len(lengths)
    pool = torch.randn(N + 2, hv, D, D, generator=gen(seed + 1)).mul(0.1).cuda()
    idx = torch.tensor([(3 * i + 2) % (N + 2) for i in range(N)], dtype=torch.int32, device="cuda")  # out of order
    has_init = torch.tensor([i % 3 != 1 for i in range(N)], device="cuda")
    if N > 2:
        idx[2] = -1  # a padded row
    kw = dict(scale=D ** -0.5, cu_seqlens=cu_seqlens(lengths, "cuda"), state_indices=idx, has_initial_state=has_init)
    return q, k, v, g, beta, pool, kw


@pytest.mark.parametrize("hk,hv", HEADS)
@pytest.mark.parametrize("lengths", [[1, 63, 64, 65, 1000, 300], [4096]], ids=["mixed", "one"])
def test_chunk_heads(hk, hv, lengths):
    """chunk_gated_delta_rule's default configuration (on the H200: the Gluon prep and chain where the head count
    allows) at each head count, a mixed batch (lengths 1..1000, a padded row, slots out of order, some initial
    states) and one sequence (its own column-slice rule)."""
    from deltaserve.ops.gdn import triton_chunk as tc

    q, k, v, g, beta, pool, kw = _prefill_case(lengths, hk, hv, seed=hv + hk)
    p_ref, p_tri = pool.clone(), pool.clone()
    o_ref = ref.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_ref, **kw)
    o_tri = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_tri, **kw)
    torch.cuda.synchronize()
    _report(test="chunk_heads", hk=hk, hv=hv, seqs=len(lengths), out_rel=rel_err(o_tri, o_ref),
            state_rel=rel_err(p_tri, p_ref))
    assert_close(o_tri, o_ref, TOL_BF16, "output")
    assert_close(p_tri, p_ref, TOL_BF16, "state")
    if len(lengths) > 2:
        pad = slice(sum(lengths[:2]), sum(lengths[:3]))
        assert (o_tri[pad] == 0).all(), "the padded row's outputs are zeros"


@pytest.mark.parametrize("hk,hv", HEADS)
def test_chunk_heads_balanced_batch(hk, hv):
    """A balanced batch (6 sequences of 250-320 tokens, their longest passed as max_seqlen, as the engine does):
    on the H200 the transposed chain where the head count allows, else the untransposed or Triton one."""
    from deltaserve.ops.gdn import gluon_chain as gc
    from deltaserve.ops.gdn import triton_chunk as tc

    lengths = [300, 257, 320, 250, 299, 318]
    q, k, v, g, beta, pool, kw = _prefill_case(lengths, hk, hv, seed=hv * 3 + hk)
    cfg = tc.default_chunk_config(len(lengths), hv, D, torch.bfloat16, k=D, tokens=sum(lengths), max_seqlen=320,
                                  gluon=gc.supported(torch.device("cuda")) and gc.heads_supported(hv),
                                  sms=torch.cuda.get_device_properties(0).multi_processor_count)
    p_ref, p_tri = pool.clone(), pool.clone()
    o_ref = ref.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_ref, **kw)
    o_tri = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_tri, max_seqlen=320, **kw)
    torch.cuda.synchronize()
    _report(test="chunk_heads_balanced", hk=hk, hv=hv, chain=cfg.chain, out_rel=rel_err(o_tri, o_ref),
            state_rel=rel_err(p_tri, p_ref))
    assert_close(o_tri, o_ref, TOL_BF16, "output")
    assert_close(p_tri, p_ref, TOL_BF16, "state")
    pad = slice(sum(lengths[:2]), sum(lengths[:3]))
    assert (o_tri[pad] == 0).all(), "the padded row's outputs are zeros"


@pytest.mark.parametrize("hk,hv", [(16, 16), (16, 48)])
def test_gdn_prefill_heads(hk, hv):
    """gdn_prefill (the gates from their pre-activations in the prep) at the published head counts."""
    from deltaserve.ops.gdn import triton_chunk as tc

    lengths = [100, 1000, 7]
    q, k, v, _, _, pool, kw = _prefill_case(lengths, hk, hv, seed=7)
    T = sum(lengths)
    g = gen(9)
    a = torch.randn(T, hv, generator=g).to("cuda", torch.bfloat16)
    b = torch.randn(T, hv, generator=g).to("cuda", torch.bfloat16)
    gates = dict(A_log=torch.linspace(-3.0, 1.0, hv, device="cuda"), dt_bias=torch.rand(hv, device="cuda"))
    p_ref, p_tri = pool.clone(), pool.clone()
    o_ref = ref.gdn_prefill(q, k, v, a, b, ssm_state=p_ref, **gates, **kw)
    o_tri = tc.gdn_prefill(q, k, v, a, b, ssm_state=p_tri, **gates, **kw)
    _report(test="gdn_prefill_heads", hk=hk, hv=hv, out_rel=rel_err(o_tri, o_ref), state_rel=rel_err(p_tri, p_ref))
    assert_close(o_tri, o_ref, TOL_BF16, "output")
    assert_close(p_tri, p_ref, TOL_BF16, "state")


@pytest.mark.parametrize("hk,hv", HEADS)
@pytest.mark.parametrize("B", [1, 5, 40])
def test_decode_verify_commit_heads(hk, hv, B):
    """gdn_decode, gdn_verify (ragged 1..5 tokens) and gdn_commit at each head count and at batch sizes that take
    the one-launch paths (1, 5) and the token-parallel ones (40 x 16 value heads and up), a padded row among them
    from 5 up."""
    from deltaserve.ops.gdn import triton_recurrent as tr
    from deltaserve.ops.gdn import triton_verify as tv

    dev = "cuda"
    Dc = 2 * hk * D + hv * D
    g = gen(100 + B + hv)
    conv_w = torch.randn(Dc, 4, generator=g).mul(0.5).to(dev, torch.bfloat16)
    kw = dict(conv_weight=conv_w, A_log=torch.linspace(-3, 1, hv, device=dev), dt_bias=torch.zeros(hv, device=dev),
              norm_weight=torch.rand(D, generator=g).add(0.5).to(dev, torch.bfloat16), eps=1e-6, scale=D ** -0.5)
    conv_pool = torch.randn(B + 1, 3, Dc, generator=g).to(dev, torch.bfloat16)
    ssm_pool = torch.randn(B + 1, hv, D, D, generator=g).mul(0.1).to(dev)
    idx = torch.randperm(B + 1, generator=g)[:B].to(dev, torch.int32)
    if B >= 5:
        idx[B // 2] = -1

    def acts(T):
        return (torch.randn(T, Dc, generator=g).to(dev, torch.bfloat16),
                torch.randn(T, hv, D, generator=g).to(dev, torch.bfloat16),
                torch.randn(T, hv, generator=g).to(dev, torch.bfloat16),
                torch.randn(T, hv, generator=g).to(dev, torch.bfloat16))

    mixed, z, a, b = acts(B)
    c1, s1, c2, s2 = conv_pool.clone(), ssm_pool.clone(), conv_pool.clone(), ssm_pool.clone()
    want = ref.gdn_decode(mixed, z, a, b, conv_state=c1, ssm_state=s1, state_indices=idx, **kw)
    got = tr.gdn_decode(mixed, z, a, b, conv_state=c2, ssm_state=s2, state_indices=idx, **kw)
    torch.cuda.synchronize()
    _report(test="decode_heads", hk=hk, hv=hv, B=B, out_rel=rel_err(got, want), state_rel=rel_err(s2, s1))
    assert_close(got, want, TOL_BF16, "decode output")
    # The kernels round each conv output to bf16 as the reference does, but sum the taps in their own order: a
    # rounding flip of one k element moves its head's state by up to ~2e-4 of the largest (seen at 40 x 16 heads,
    # the token-parallel path). A wrong head, slot or window would be O(1), so the bound on the whole is tight.
    assert_close(s2, s1, 2e-3, "decode state")
    whole = ((s2 - s1).norm() / s1.norm()).item()
    assert whole <= 1e-4, f"decode state: relative error of the whole pool {whole:.3g} > 1e-4"
    assert torch.equal(c2, c1), "decode conv windows"

    lengths = [1 + (3 * i + 1) % 5 for i in range(B)]
    cu = cu_seqlens(lengths, dev)
    T = sum(lengths)
    mixed, z, a, b = acts(T)
    accepted = torch.tensor([(i * 7) % (n + 1) for i, n in enumerate(lengths)], dtype=torch.int32, device=dev)
    outs, pools = [], []
    for ops in (ref, tv):
        c, s = conv_pool.clone(), ssm_pool.clone()
        st = ref.VerifyStash.empty(T, conv_dim=Dc, num_k_heads=hk, head_k_dim=D, num_v_heads=hv, head_v_dim=D,
                                   dtype=torch.bfloat16, device=dev)
        outs.append(ops.gdn_verify(mixed, z, a, b, cu_seqlens=cu, conv_state=c, ssm_state=s, state_indices=idx,
                                   stash=st, **kw))
        ops.gdn_commit(accepted, cu_seqlens=cu, state_indices=idx, conv_state=c, ssm_state=s, stash=st)
        pools.append((c, s))
    torch.cuda.synchronize()
    _report(test="verify_commit_heads", hk=hk, hv=hv, B=B, out_rel=rel_err(outs[1], outs[0]),
            state_rel=rel_err(pools[1][1], pools[0][1]))
    assert_close(outs[1], outs[0], TOL_BF16, "verify output")
    assert_close(pools[1][1], pools[0][1], 2e-3, "committed state")  # bf16 conv-output rounding flips
    assert torch.equal(pools[1][0], pools[0][0]), "committed conv windows"


def test_forced_gluon_chain_refused_at_other_head_counts():
    """A configuration that forces the Gluon chain at a value-head count its boxes do not fit is refused by name."""
    from deltaserve.ops.gdn import gluon_chain as gc
    from deltaserve.ops.gdn import triton_chunk as tc

    if not gc.supported(torch.device("cuda")):
        pytest.skip("the Gluon chain needs compute capability 9.0")
    lengths = [1000]
    q, k, v, g, beta, pool, kw = _prefill_case(lengths, 8, 24, seed=5)
    cfg = tc.default_chunk_config(1, 32, D, torch.bfloat16, k=D, tokens=1000, gluon=True)
    assert cfg.chain == "gluon"
    with pytest.raises(ValueError, match="24 value heads"):
        tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=pool, config=cfg, **kw)
