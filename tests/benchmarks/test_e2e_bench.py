"""benchmarks/e2e_gpu.py --quick: the whole script (ours with dummy weights, the transformers peer, limits,
profile, report) on a tiny shape on CPU, so it cannot rot between GPU runs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "e2e_gpu.py"


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("e2e_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["e2e_gpu"] = mod                 # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_quick_run_reports_every_row(e2e, tmp_path):
    # the two parts in this process (the orchestrator runs each in a subprocess; same functions)
    assert e2e.main(["--quick", "--out", str(tmp_path), "--part", "ours"]) == 0
    assert e2e.main(["--quick", "--out", str(tmp_path), "--part", "peer"]) == 0
    out = tmp_path / "quick"
    rows = [json.loads(line) for line in (out / "ours.jsonl").read_text().splitlines()]
    conc = {r["C"]: r for r in rows if r["what"] == "concurrency"}
    assert set(conc) == set(e2e.QUICK.concurrency)
    for C, r in conc.items():
        assert r["output_tokens"] == C * e2e.QUICK.new_tokens
        assert r["decode_steps"] > 0 and r["decode_tok_s"] > 0
        assert r["limit"]["bytes"] > 0 and 0 < r["frac_of_limit"]
        assert r["distinct_experts_actual"] is not None, "the router's choices were recorded"
    assert {r["prompt_len"] for r in rows if r["what"] == "ttft"} == set(e2e.QUICK.ttft_lens)
    assert len(next(r for r in rows if r["what"] == "concurrency_repeats")["decode_tok_s"]) == 2
    copy = next(r for r in rows if r["what"] == "copy_bandwidth")
    assert len(copy["samples"]) == 2 and copy["bytes_per_s"] == max(copy["samples"]), "the higher of two"
    prof = next(r for r in rows if r["what"] == "profile")
    assert prof["steps"] == e2e.QUICK.profile_steps and prof["family_us"]
    prefill = [r for r in rows if r["what"] == "prefill_profile"]
    assert [r["decoding"] > 0 for r in prefill] == [False, False, True], "one long, many short, many beside decodes"
    assert all(r["wall_ms"] > 0 and r["kernels"] > 0 for r in prefill)
    peer = [json.loads(line) for line in (out / "peer.jsonl").read_text().splitlines()]
    assert {r["B"] for r in peer if r["what"] == "peer_decode"} == set(e2e.QUICK.peer_batches)
    text = e2e.report(out, "quick", e2e.QUICK)
    assert "| decode tok/s, concurrency 1" in text and "| time to first token, 32 tokens" in text
    assert "Profile of a batch-1 decode step" in text and "run twice more in the same process" in text


def test_limits(e2e):
    """Distinct experts of uniform routing, and a step limit that grows with what the step moves."""
    assert e2e.uniform_distinct(256, 8, 1) == pytest.approx(8)
    assert e2e.uniform_distinct(256, 8, 10_000) == pytest.approx(256)
    info = dict(dense=1e9, embed_row=4096, moe_layers=40, expert=6.29e6, kv_per_token=20480, state_rw=1.3e8)
    one = e2e.step_limit(info, 1, 1000, 8, 4e12)
    assert one["bytes"] == pytest.approx(1e9 + 4096 + 40 * 8 * 6.29e6 + 1001 * 20480 + 1.3e8)
    assert one["tok_s"] == pytest.approx(4e12 / one["bytes"])
    assert e2e.step_limit(info, 8, 1000, 60, 4e12)["tok_s"] > one["tok_s"]


@pytest.mark.parametrize("name,fam", [
    ("_gemv_w13_kernel", "MoE"), ("_gemv_w2_combine_kernel", "MoE"), ("_topk_softmax_kernel", "MoE"),
    ("_route_kernel", "MoE"), ("_route_shared_kernel", "MoE"), ("_gemv_w13_split_kernel", "MoE"),
    ("_embed_rope_kernel", "embedding"),
    ("_tokens_kernel", "GDN"), ("_finish_kernel", "GDN"), ("_rms_norm_gated_kernel", "GDN"),
    ("_conv_update_kernel", "GDN"), ("fused_recurrent_gated_delta_rule_fwd_kernel", "GDN"),
    ("_decode_fused_kernel", "GDN"), ("_gemv_fma_kernel", "linears"), ("_gemv_dot_kernel", "linears"),
    ("_split_sum_kernel", "linears"), ("_gemv_w2_all_kernel", "MoE"), ("_attention_kernel", "attention"),
    ("_merge_splits_kernel", "attention"), ("_store_kv_kernel", "attention"), ("_attn_prologue_kernel", "attention"),
    ("_decode_attention_kernel", "attention"), ("_gemv_gated_kernel", "linears"),
    ("_rms_norm_kernel", "norms"), ("_silu_and_mul_kernel", "activations"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", "linears"), ("void gemv2T_kernel_val<int, int, __nv_bfloat16>", "linears"),
])
def test_kernel_families(e2e, name, fam):
    assert e2e.family(name).startswith(fam)


@pytest.mark.slow
def test_fp32_attention_default_tiles_fit_sm90_shared_memory():
    """Compiles the fp32 default attention tiles for sm_90 without a GPU (~25 s): the bf16 prefill tile in
    fp32 needed 295 KB of shared memory (a block has 227 KB), so fp32 models failed on the GPU."""
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(bench.parent)
    run = subprocess.run([sys.executable, str(bench / "attention_moe_compile_check.py"), "--fp32-attention"],
                         cwd=bench, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_compile_recorder_reports_builds_and_restores_the_hooks(e2e):
    import types

    import triton

    knobs = triton.knobs.runtime
    before = (knobs.jit_cache_hook, knobs.jit_post_compile_hook)
    rec = e2e.CompileRecorder()
    fn = types.SimpleNamespace(name="_gemv_fma_kernel", arg_names=["x", "M", "BN"])
    key = ((("*bf16", "D"), ("i32", "1"), ("constexpr", 16)), "options")      # Triton 3.6's cache key
    extra = dict(compile={}, is_manual_warmup=False, already_compiled=False)
    assert knobs.jit_cache_hook(key=key, repr="r", fn=fn, **extra) is False     # the build goes on
    knobs.jit_post_compile_hook(key=key, repr="_gemv_fma_kernel[num_warps=4](x: ()", fn=fn, **extra)
    got = rec.take()
    assert got["compiles"] == 1 and got["compile_s"] >= 0 and got["compiled"][0].startswith("_gemv_fma_kernel")
    assert got["variants"] == ["_gemv_fma_kernel(x=*bf16/D, M=i32/1, BN=constexpr/16)"]
    real = "[('*bf16', 'D'), ('i32', None), ('constexpr', 37)]{'num_warps': 4, 'debug': False}"   # Triton 3.6
    assert e2e.CompileRecorder.describe(real, fn) == "_gemv_fma_kernel(x=*bf16/D, M=i32, BN=constexpr/37)"
    assert rec.take()["compiles"] == 0
    rec.remove()
    assert (knobs.jit_cache_hook, knobs.jit_post_compile_hook) == before
