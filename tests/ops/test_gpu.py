"""Real-shape checks on a CUDA device (Qwen3-Next GDN shape: 16 key heads, 32 value heads, dk = dv = 128;
bf16 activations, fp32 state), skipped without CUDA. Errors are relative to the fp32 reference run on
the same bf16 inputs. The 8k-token error is printed (run with -s) and, with DELTASERVE_GPU_REPORT set,
appended to that JSON-lines file."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.gdn import reference as ref

from .helpers import assert_close, cu_seqlens, gen, rel_err, require_fla

pytestmark = pytest.mark.gpu

HK, HV, D = 16, 32, 128
TOL_BF16 = 3e-2  # bf16 activations and outputs; bf16 / tf32 dot operands


def _report(**row) -> None:
    print(json.dumps(row))
    path = os.environ.get("DELTASERVE_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _inputs(lengths, hk, hv, *, seed, mild_decay=False):
    g = gen(seed)
    T = sum(lengths)
    dev = "cuda"
    q = torch.randn(T, hk, D, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(T, hk, D, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(T, hv, D, generator=g).to(dev, torch.bfloat16)
    if mild_decay:  # slow forgetting (long memory): the hardest case for error build-up
        gg = F.logsigmoid(torch.randn(T, hv, generator=g)).div(16).to(dev)
    else:
        A_log = torch.linspace(-3.0, 2.0, hv)
        gg = (-A_log.exp() * F.softplus(torch.randn(T, hv, generator=g))).to(dev)
    beta = torch.rand(T, hv, generator=g).to(dev)
    return q, k, v, gg, beta


def _case_8k():
    """One 8192-token sequence with slow decay (long memory: the hardest case for error build-up) from an
    initial state, and the fp32 token-by-token recurrence on it: (q, k, v, g, beta, pool, op kwargs, the
    recurrence's output and final state)."""
    T = 8192
    q, k, v, g, beta = _inputs([T], HK, HV, seed=8, mild_decay=True)
    pool = torch.randn(1, HV, D, D, generator=gen(2)).mul(0.1).cuda()
    kw = dict(scale=D ** -0.5, cu_seqlens=cu_seqlens([T], "cuda"),
              state_indices=torch.zeros(1, dtype=torch.int32, device="cuda"),
              has_initial_state=torch.ones(1, dtype=torch.bool, device="cuda"))
    p_rec = pool.clone()
    o_rec = ref.recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state=p_rec, **kw)
    return q, k, v, g, beta, pool, kw, o_rec, p_rec


def _fla_8k(q, k, v, g, beta, pool, kw):
    """FLA's chunked output [T, HV, D] and final state on a _case_8k case (ImportError without FLA)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    o, st = fla_chunk(q[None], k[None], v[None], g[None], beta[None], scale=D ** -0.5, initial_state=pool.clone(),
                      output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=kw["cu_seqlens"].long())
    return o[0], st


def check_8k_not_less_accurate_than_fla(configs: dict, test: str) -> None:
    """Each chunk configuration (name -> ChunkConfig, None for the default) on the _case_8k sequence: its output
    and final-state errors against the fp32 recurrence must not exceed FLA's on the same inputs. Every row is
    reported as soon as it is measured (a run cut short keeps them); fails without FLA (helpers.require_fla)."""
    from deltaserve.ops.gdn import triton_chunk as tc

    q, k, v, g, beta, pool, kw, o_rec, p_rec = _case_8k()
    rows = {}
    for name, cfg in configs.items():
        p = pool.clone()
        o = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p, config=cfg, **kw)
        rows[name] = (rel_err(o, o_rec), rel_err(p, p_rec))
        _report(test=test, impl=name, out_rel=rows[name][0], state_rel=rows[name][1])
    require_fla()
    o, st = _fla_8k(q, k, v, g, beta, pool, kw)
    fla = (rel_err(o, o_rec), rel_err(st, p_rec))
    _report(test=test, impl="fla", out_rel=fla[0], state_rel=fla[1])
    worse = {name: r for name, r in rows.items() if r[0] > fla[0] or r[1] > fla[1]}
    assert not worse, f"less accurate than FLA {fla}: {worse}"


def _prep_reference(q, k, v, g, beta, lengths, scale, hv):
    """What kernel 1 stores, in fp32 torch: per token row W = T diag(beta exp(G)) K^ and U = T diag(beta) V
    with T the UT inverse of its chunk, the gated scores P of its chunk (lower triangle, zeros above), the
    chunk-local cumulative decay G, and the q (times scale) / k inverse norms."""
    T = q.shape[0]
    hk = q.shape[1]
    r = hv // hk
    Wm = torch.zeros(T, hv, D, device=q.device)
    Um = torch.zeros(T, hv, D, device=q.device)
    Pm = torch.zeros(T, hv, 64, device=q.device)
    G = torch.zeros(T, hv, device=q.device)
    qf, kf = q.float(), k.float()
    rq = torch.rsqrt(qf.pow(2).sum(-1) + 1e-6) * scale
    rk = torch.rsqrt(kf.pow(2).sum(-1) + 1e-6)
    qn = (qf * rq[..., None]).repeat_interleave(r, 1)
    kn = (kf * rk[..., None]).repeat_interleave(r, 1)
    start = 0
    for n in lengths:
        for c0 in range(start, start + n, 64):
            c1 = min(c0 + 64, start + n)
            L = c1 - c0
            Gc = g[c0:c1].cumsum(0).T                                   # [hv, L]
            diff = Gc[:, :, None] - Gc[:, None, :]
            low = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            E = torch.where(low, diff, torch.full_like(diff, float("-inf"))).exp()
            kk = kn[c0:c1].transpose(0, 1)                              # [hv, L, K]
            bt = beta[c0:c1].T.float()                                   # [hv, L]
            A = (bt[:, :, None] * (kk @ kk.transpose(1, 2)) * E).tril(-1)
            eye = torch.eye(L, device=q.device).expand(hv, L, L)
            Tm = torch.linalg.solve_triangular(eye + A, eye, upper=False)
            Wm[c0:c1] = (Tm @ (kk * (bt * Gc.exp())[:, :, None])).transpose(0, 1)
            Um[c0:c1] = (Tm @ (v[c0:c1].float().transpose(0, 1) * bt[:, :, None])).transpose(0, 1)
            Pm[c0:c1, :, :L] = ((qn[c0:c1].transpose(0, 1) @ kk.transpose(1, 2)) * E).transpose(0, 1)
            G[c0:c1] = Gc.T
        start += n
    return dict(Wb=Wm, Ub=Um, Pb=Pm, Gb=G, rq=rq, rk=rk)


def test_chunk_prep_buffers_match_torch():
    """Kernel 1 alone: W, U, P, G and the norms of every chunk against torch (localises failures)."""
    from deltaserve.ops.gdn import triton_chunk as tc

    lengths = [1, 63, 64, 65, 300]
    q, k, v, g, beta = _inputs(lengths, HK, HV, seed=12)
    cfg = dataclasses.replace(tc.default_chunk_config(len(lengths), HV, D, torch.bfloat16), layout="token")
    bufs = tc.launch_prep(q, k, v, g, beta, False, None, None, D ** -0.5, cu_seqlens(lengths, "cuda"), len(lengths),
                           True, cfg)
    want = _prep_reference(q, k, v, g, beta, lengths, D ** -0.5, HV)
    errs = {name: rel_err(bufs[name], want[name]) for name in ("Wb", "Ub", "Pb", "Gb", "rq", "rk")}
    _report(test="chunk_prep_buffers", **errs)
    for name, err in errs.items():
        assert err < 2e-2, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("prec", ["bf16x2", "bf16", "tf32"])
def test_chunk_state_kernel_with_torch_buffers(prec):
    """Kernel 2 alone, fed kernel 1's outputs computed by torch, against the reference (localises)."""
    from deltaserve.ops.gdn import triton_chunk as tc

    lengths = [1, 63, 64, 65, 300]
    q, k, v, g, beta = _inputs(lengths, HK, HV, seed=13)
    N = len(lengths)
    cfg = tc.ChunkConfig(prec=prec)
    bufs = _prep_reference(q, k, v, g, beta, lengths, D ** -0.5, HV)
    op_dtype = tc.operand_dtype(prec)
    bufs["Wb"], bufs["Pb"] = bufs["Wb"].to(op_dtype), bufs["Pb"].to(op_dtype)
    pool = torch.randn(N, HV, D, D, generator=gen(3)).mul(0.1).cuda()
    kw = dict(scale=D ** -0.5, cu_seqlens=cu_seqlens(lengths, "cuda"),
              state_indices=torch.arange(N, dtype=torch.int32, device="cuda"),
              has_initial_state=torch.ones(N, dtype=torch.bool, device="cuda"))
    p_ref, p_tri = pool.clone(), pool.clone()
    o_ref = ref.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_ref, **kw)
    o_tri = torch.empty_like(v)
    tc.launch_chain(q, k, v, o_tri, bufs, kw["cu_seqlens"], p_tri, kw["state_indices"], kw["has_initial_state"], cfg)
    _report(test="chunk_state_kernel", prec=prec, out_rel=rel_err(o_tri, o_ref), state_rel=rel_err(p_tri, p_ref))
    assert_close(o_tri, o_ref, TOL_BF16, "output")
    assert_close(p_tri, p_ref, TOL_BF16, "state")


@pytest.mark.parametrize("hk,prec", [(32, None), (16, None), (8, None), (16, "bf16"), (16, "tf32")])
def test_chunk_real_shape_mixed_batch(hk, prec):
    from deltaserve.ops.gdn import triton_chunk as tc

    lengths = [1, 63, 64, 65, 1000]
    q, k, v, g, beta = _inputs(lengths, hk, HV, seed=hk)
    N = len(lengths)
    pool = torch.randn(N + 2, HV, D, D, generator=gen(1)).mul(0.1).cuda()
    idx = torch.tensor([5, 0, -1, 3, 1], dtype=torch.int32, device="cuda")
    has_init = torch.tensor([True, False, True, True, False], device="cuda")
    kw = dict(scale=D ** -0.5, cu_seqlens=cu_seqlens(lengths, "cuda"), state_indices=idx,
              has_initial_state=has_init)
    p_ref, p_tri = pool.clone(), pool.clone()
    o_ref = ref.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_ref, **kw)
    cfg = tc.ChunkConfig(prec=prec) if prec else None
    o_tri = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_tri, config=cfg, **kw)
    _report(test="chunk_mixed", hk=hk, prec=prec or "default", out_rel=rel_err(o_tri, o_ref),
            state_rel=rel_err(p_tri, p_ref))
    assert_close(o_tri, o_ref, TOL_BF16, "output")
    assert_close(p_tri, p_ref, TOL_BF16, "state")
    assert (o_tri[64:128] == 0).all(), "padded sequence gives zeros"


def test_chunk_8k_vs_fp32_token_recurrence():
    """One 8192-token sequence, chunked (Triton, three operand precisions; FLA, required) against the
    fp32 token-by-token recurrence. Mild decays (long memory) so errors can accumulate."""
    from deltaserve.ops.gdn import triton_chunk as tc

    q, k, v, g, beta, pool, kw, o_rec, p_rec = _case_8k()
    rows = {}
    for prec in (None, "bf16", "tf32"):
        p = pool.clone()
        o = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p, config=tc.ChunkConfig(prec=prec) if prec else None,
                                      **kw)
        rows[f"ours {prec or 'default'}"] = (rel_err(o, o_rec), (o.float() - o_rec.float()).abs().max().item(),
                                             rel_err(p, p_rec))
    require_fla()
    o, st = _fla_8k(q, k, v, g, beta, pool, kw)
    rows["fla"] = (rel_err(o, o_rec), (o.float() - o_rec.float()).abs().max().item(), rel_err(st, p_rec))
    for name, (out_rel, out_abs, state_rel) in rows.items():
        _report(test="chunk_8k_vs_fp32_recurrence", impl=name, out_rel=out_rel, out_max_abs=out_abs,
                out_max=o_rec.float().abs().max().item(), state_rel=state_rel)
    ours = rows["ours default"]
    assert ours[0] < 1e-2 and ours[2] < 1e-2
    # the bar: not less accurate than FLA on the same inputs
    assert ours[0] <= rows["fla"][0] and ours[2] <= rows["fla"][2], rows


def test_decode_verify_commit_real_shape():
    from deltaserve.ops.gdn import triton_recurrent as tr
    from deltaserve.ops.gdn import triton_verify as tv

    B = 64
    dev = "cuda"
    Dc = 2 * HK * D + HV * D
    g = gen(4)
    conv_w = torch.randn(Dc, 4, generator=g).mul(0.5).to(dev, torch.bfloat16)
    kw = dict(conv_weight=conv_w, A_log=torch.linspace(-3, 1, HV, device=dev), dt_bias=torch.zeros(HV, device=dev),
              norm_weight=torch.ones(D, dtype=torch.bfloat16, device=dev), eps=1e-6, scale=D ** -0.5)
    conv_pool = torch.randn(B + 1, 3, Dc, generator=g).to(dev, torch.bfloat16)
    ssm_pool = torch.randn(B + 1, HV, D, D, generator=g).mul(0.1).to(dev)
    idx = torch.randperm(B + 1, generator=g)[:B].to(dev, torch.int32)
    idx[B // 2] = -1
    # decode
    mixed = torch.randn(B, Dc, generator=g).to(dev, torch.bfloat16)
    z = torch.randn(B, HV, D, generator=g).to(dev, torch.bfloat16)
    a = torch.randn(B, HV, generator=g).to(dev, torch.bfloat16)
    b = torch.randn(B, HV, generator=g).to(dev, torch.bfloat16)
    c1, s1, c2, s2 = conv_pool.clone(), ssm_pool.clone(), conv_pool.clone(), ssm_pool.clone()
    want = ref.gdn_decode(mixed, z, a, b, conv_state=c1, ssm_state=s1, state_indices=idx, **kw)
    got = tr.gdn_decode(mixed, z, a, b, conv_state=c2, ssm_state=s2, state_indices=idx, **kw)
    _report(test="decode_B64", out_rel=rel_err(got, want), state_rel=rel_err(s2, s1))
    assert_close(got, want, TOL_BF16, "decode output")
    assert_close(s2, s1, 1e-4, "decode state")
    assert torch.equal(c2, c1)
    # verify + commit vs the reference, ragged T_n in 2..5
    lengths = [2 + (i % 4) for i in range(B)]
    cu = cu_seqlens(lengths, dev)
    T = sum(lengths)
    mixed = torch.randn(T, Dc, generator=g).to(dev, torch.bfloat16)
    z = torch.randn(T, HV, D, generator=g).to(dev, torch.bfloat16)
    a = torch.randn(T, HV, generator=g).to(dev, torch.bfloat16)
    b = torch.randn(T, HV, generator=g).to(dev, torch.bfloat16)
    accepted = torch.tensor([(i * 7) % (n + 1) for i, n in enumerate(lengths)], dtype=torch.int32, device=dev)
    outs, pools = [], []
    for ops in (ref, tv):
        c, s = conv_pool.clone(), ssm_pool.clone()
        st = ref.VerifyStash.empty(T, conv_dim=Dc, num_k_heads=HK, head_k_dim=D, num_v_heads=HV, head_v_dim=D,
                                   dtype=torch.bfloat16, device=dev)
        outs.append(ops.gdn_verify(mixed, z, a, b, cu_seqlens=cu, conv_state=c, ssm_state=s, state_indices=idx,
                                   stash=st, **kw))
        ops.gdn_commit(accepted, cu_seqlens=cu, state_indices=idx, conv_state=c, ssm_state=s, stash=st)
        pools.append((c, s))
    _report(test="verify_commit_B64", out_rel=rel_err(outs[1], outs[0]), state_rel=rel_err(pools[1][1], pools[0][1]))
    assert_close(outs[1], outs[0], TOL_BF16, "verify output")
    assert_close(pools[1][1], pools[0][1], 2e-3, "committed state")  # bf16 conv-output rounding flips
    assert torch.equal(pools[1][0], pools[0][0]), "committed conv windows"


def test_cuda_graph_replay_equals_eager():
    """Prefill (varlen) and decode captured in CUDA graphs give the eager results (no host sync inside)."""
    from deltaserve.ops.gdn import triton_chunk as tc
    from deltaserve.ops.gdn import triton_recurrent as tr
    from deltaserve.ops.gdn import triton_verify as tv

    lengths = [100, 1, 300]
    q, k, v, g, beta = _inputs(lengths, HK, HV, seed=3)
    pool = torch.randn(4, HV, D, D, generator=gen(5)).mul(0.1).cuda()
    kw = dict(scale=D ** -0.5, cu_seqlens=cu_seqlens(lengths, "cuda"),
              state_indices=torch.tensor([2, 0, 3], dtype=torch.int32, device="cuda"),
              has_initial_state=torch.tensor([True, False, True], device="cuda"))
    p_eager, p_graph = pool.clone(), pool.clone()
    o_eager = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_eager, **kw)
    tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_graph.clone(), **kw)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_graph, **kw)
    p_graph.copy_(pool)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o_eager) and torch.equal(p_graph, p_eager)

    qd, kd, vd = q[:3], k[:3], v[:3]
    idx = torch.tensor([1, -1, 2], dtype=torch.int32, device="cuda")
    p_eager, p_graph = pool.clone(), pool.clone()
    o_eager = tr.fused_recurrent_gated_delta_rule(qd, kd, vd, g[:3], beta[:3], scale=D ** -0.5, ssm_state=p_eager,
                                                  state_indices=idx)
    tr.fused_recurrent_gated_delta_rule(qd, kd, vd, g[:3], beta[:3], scale=D ** -0.5, ssm_state=p_graph.clone(),
                                        state_indices=idx)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph = tr.fused_recurrent_gated_delta_rule(qd, kd, vd, g[:3], beta[:3], scale=D ** -0.5,
                                                      ssm_state=p_graph, state_indices=idx)
    p_graph.copy_(pool)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o_eager) and torch.equal(p_graph, p_eager)
