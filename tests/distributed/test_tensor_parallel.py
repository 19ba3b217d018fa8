"""Tensor / expert parallelism over gloo on CPU, two processes: the TP = 2 (and EP = 2) engine gives the TP = 1
greedy tokens and prompt logprobs (fp32, within 1e-4) with chunked prefill, mixed prefill + decode batches
and preemption; a killed worker ends the run with an error within seconds; shutdown ends every worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.distributed.comm import PeerFailure, free_port
from deltaserve.distributed.parallel import ShardingError
from tests.conftest import TinySpec, random_ids

PROMPT_LENGTHS = (3, 70, 21, 45)      # over the 32-token budget: chunked; short ones decode beside chunks
ENGINE = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 32, "max_num_seqs": 4, "num_gpu_blocks": 9,
          "block_size": 16}
PARAMS = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=0, ignore_eos=True)


def _run(llm: LLM):
    prompts = [random_ids(n, seed=n) for n in PROMPT_LENGTHS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return prompts, outs, llm.engine.get_stats().num_preempted_total


def _assert_same(ref, ours) -> None:
    prompts, ref_outs, _ = ref
    _, outs, preempted = ours
    assert preempted > 0, "the small KV pool should force preemption"
    for ids, a, b in zip(prompts, ref_outs, outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        err = max(abs(a.prompt_logprobs[i][ids[i]].logprob - b.prompt_logprobs[i][ids[i]].logprob)
                  for i in range(1, len(ids)))
        assert err < 1e-4, f"prompt logprobs of a {len(ids)}-token prompt differ by {err}"


@pytest.mark.parametrize("spec,ep", [
    (TinySpec(family="qwen3_next", ratio=2, mtp=True), False),
    (TinySpec(family="qwen3_5", ratio=3, seed=3), False),
    (TinySpec(family="qwen3_5_moe", ratio=2, fused_experts=True, seed=5), False),
    (TinySpec(family="qwen3_5_moe", ratio=2, fused_experts=True, seed=5), True),
    (TinySpec(family="qwen3_next", ratio=2, mtp=True), True),
], ids=["next-tp2", "qwen3_5-tp2", "qwen3_5_moe-tp2", "qwen3_5_moe-ep2", "next-ep2"])
def test_tp2_matches_tp1(tiny_model, spec, ep):
    path = tiny_model(spec)
    ref = _run(LLM(path, **ENGINE))
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=ep, **ENGINE)
    try:
        _assert_same(ref, _run(llm))
    finally:
        llm.shutdown()
    assert all(not p.is_alive() for p in llm.engine.runner.processes)


def test_dummy_weights_tp2_match_tp1(tiny_model):
    from tests.conftest import _text_config
    cfg = {**_text_config(TinySpec(family="qwen3_next", ratio=2)), "model_type": "qwen3_next"}
    ref = _run(LLM(cfg, load_format="dummy", **ENGINE))
    llm = LLM(cfg, load_format="dummy", tensor_parallel_size=2, **ENGINE)
    try:
        _assert_same(ref, _run(llm))
    finally:
        llm.shutdown()


def test_shapes_that_do_not_divide_are_refused_before_any_process_starts(tiny_model):
    with pytest.raises(ShardingError, match="linear_num_key_heads = 2 is not divisible by tensor_parallel_size = 3"):
        LLM(tiny_model(TinySpec(family="qwen3_5")), tensor_parallel_size=3, **ENGINE)


def test_killed_worker_ends_the_run_with_an_error_within_seconds(tiny_model):
    llm = LLM(tiny_model(TinySpec(family="qwen3_5")), tensor_parallel_size=2, **ENGINE)
    try:
        worker = llm.engine.runner.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PeerFailure, match=r"rank 1 \(pid \d+\) exited with code -9"):
            llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=50, ignore_eos=True),
                         use_tqdm=False)
        assert time.monotonic() - t0 < 5
    finally:
        llm.shutdown()


def test_worker_killed_mid_run_breaks_the_step(tiny_model):
    """Killed while steps run (the collectives see the closed connection): the engine raises, no hang."""
    llm = LLM(tiny_model(TinySpec(family="qwen3_5")), tensor_parallel_size=2, **ENGINE)
    try:
        engine, worker = llm.engine, llm.engine.runner.processes[0]
        engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=400, ignore_eos=True))
        engine.step()
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PeerFailure, match="rank 1"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < 5
    finally:
        llm.shutdown()


def _env() -> dict:
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def test_interpreter_exit_ends_the_workers(tiny_model):
    """No shutdown() call: the workers still end with the engine's process."""
    script = textwrap.dedent(f"""
        from deltaserve import LLM
        if __name__ == "__main__":
            llm = LLM({str(tiny_model(TinySpec(family="qwen3_5")))!r}, device="cpu", tensor_parallel_size=2)
            print(llm.engine.runner.processes[0].pid, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=_env(),
                         check=False)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), "the worker outlived the engine's process"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:        # a zombie waiting for its reaper counts as gone
        return f.read().split()[2] != "Z"


def test_torchrun_single_node_matches_one_process(tiny_model):
    """The multi-node entry point on one node: `torchrun --nproc-per-node 2 -m deltaserve generate -tp 2`."""
    path = tiny_model(TinySpec(family="qwen3_5_moe", ratio=2, fused_experts=True, seed=5))
    args = ["generate", "--model", str(path), "--device", "cpu", "--prompt-token-ids", "[5, 9, 2, 7, 1]",
            "--max-tokens", "6", "--temperature", "0", "--json"]
    torchrun = Path(sys.executable).with_name("torchrun")
    port = str(free_port())
    tp = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", port, "-m", "deltaserve", *args,
                         "-tp", "2"], capture_output=True, text=True, timeout=180, env=_env(), check=False)
    assert tp.returncode == 0, tp.stderr[-3000:]
    one = subprocess.run([sys.executable, "-m", "deltaserve", *args], capture_output=True, text=True, timeout=120,
                         env=_env(), check=False)
    assert one.returncode == 0, one.stderr[-3000:]
    tokens = [json.loads(line)["token_ids"] for line in tp.stdout.splitlines() if line.startswith("{")]
    assert tokens == [json.loads(one.stdout.splitlines()[-1])["token_ids"]]   # printed once: by rank 0
