"""Tensor-parallel execution: rank 0's Worker in the engine process, ranks 1..N-1 in worker processes.

Start-up (`start_tensor_parallel`): spawn the N-1 workers (torch.multiprocessing "spawn", one per device;
CPU ranks for tests) or, under torchrun, find them already running; every rank joins the process group
(gloo on CPU, NCCL on CUDA), loads its shard, and the pools are planned on the smallest budget of all ranks
(each rank computes the same plan from it). Each step, rank 0 broadcasts the scheduler's plain
`SchedulerOutput` (step_io.py) and every rank runs the same step; every rank samples the same token from
the all-gathered logits (same seeds), and only rank 0's RunnerOutput goes back to the engine.

Decode CUDA graphs per rank (on by default on CUDA): every rank plans the same buckets from the same config
(agreed at start-up: one rank that cannot capture makes them all decode eagerly), captures them in the same
order (largest first, runner/cuda_graphs.py) after the NCCL communicator is warmed up (a collective
inside a capture cannot create it), and, given the same broadcast SchedulerOutput, replays the same bucket
each decode step, so the all-reduces captured in the graphs pair up across the ranks.

Failure: a worker that dies breaks the step's collectives at once (closed connection; the collectives also
time out, distributed/comm.py), the engine's next step raises `PeerFailure` naming the rank and its exit
code, and a watchdog thread logs the death as it happens. A collective captured in a CUDA graph has no
timeout (a replay waiting on a dead peer spins on the GPU and rank 0's next sync never returns): with graphs
on CUDA, a death while a step is in flight that the step does not report within HANG_GRACE_S ends rank 0's
process (exit 1, logged), never a hang. Workers exit when rank 0's process is gone.
`shutdown()` (LLM.shutdown, the server's exit, interpreter exit) stops and joins every worker.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
from multiprocessing.connection import wait
from typing import Any

import torch

from ..cache.plan import plan_cache
from ..distributed import comm
from ..distributed.comm import PeerFailure
from ..distributed.parallel import Parallel
from ..runner.worker import Worker, WorkerConfig

logger = logging.getLogger(__name__)

_STOP = ("stop", None)
_JOIN_TIMEOUT_S = 10.0
HANG_GRACE_S = 5.0          # a rank died with a graph step in flight: how long the step gets to fail by itself

# Decode buckets every rank captures whatever its device (tests set it: on CPU the capture is DecodeGraphs'
# eager stand-in over the static buffers); None: each rank's own plan (CUDA graphs on CUDA, eager elsewhere).
forced_graph_sizes: list[int] | None = None


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One device per rank: cuda:rank on GPUs (counted from the device given), the CPU otherwise."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _start_rank(config: WorkerConfig, graph_sizes: list[int] | None = None) -> Worker:
    """Every rank's start-up after joining the group: load the shard, agree on the decode graphs, plan on the
    smallest budget, allocate (and capture). graph_sizes: forced_graph_sizes as rank 0 saw it."""
    worker = Worker(config)
    worker.load_model()
    if graph_sizes is not None:
        worker.graph_sizes = list(graph_sizes)
    if comm.all_reduce_min(len(worker.graph_sizes)) == 0:    # every rank captures, or none
        worker.graph_sizes = []
    elif config.device.type == "cuda":
        comm.warm_up(config.device)          # the NCCL communicator exists before any capture
    if worker.graph_sizes and config.parallel.rank == 0:
        logger.info("tensor parallel %d: decode CUDA graphs on every rank (%d buckets up to %d sequences)%s",
                    config.parallel.size, len(worker.graph_sizes), max(worker.graph_sizes),
                    "" if config.device.type == "cuda" else " [the CPU stand-in: eager forwards]")
    budget = comm.all_reduce_min(worker.cache_budget())
    plan = plan_cache(worker.cache_spec(), budget_bytes=budget, max_num_seqs=config.max_num_seqs,
                      max_model_len=config.max_model_len, num_blocks=config.num_kv_blocks,
                      snapshot_fraction=config.prefix_cache_state_fraction)
    worker.initialize_cache(plan)
    return worker


def serve_steps(worker: Worker) -> None:
    """A worker rank's loop: run each step rank 0 broadcasts, until told to stop."""
    runner = worker.runner
    while True:
        kind, sched = comm.broadcast_object()
        if kind == "stop":
            return
        runner.collect(runner.launch(sched))


def _worker_main(config: WorkerConfig, init_method: str, parent_pid: int, num_threads: int,
                 graph_sizes: list[int] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING)

    def orphan_guard() -> None:   # rank 0's process gone (even killed): leave at once
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=orphan_guard, daemon=True, name="orphan-guard").start()
    torch.set_num_threads(num_threads)      # the engine process's intra-op threads, per rank
    comm.init_distributed(config.parallel, config.device, init_method=init_method)
    try:
        serve_steps(_start_rank(config, graph_sizes))
    finally:
        comm.destroy()


class TensorParallelRunner:
    """The engine's runner over N ranks: rank 0's ModelRunner, with each step broadcast to the others first.
    Everything not overridden here is rank 0's runner's."""

    def __init__(self, worker: Worker, processes: list):
        self.worker = worker
        self.runner = worker.runner
        self.processes = processes           # ranks 1.. (empty under torchrun: torchrun owns them)
        self._dead: str | None = None
        self._closing = False
        self._inflight = 0                   # steps launched and not yet collected
        self._seen = threading.Event()       # the engine has been told of the death (a step raised)
        self._may_hang = getattr(self.runner, "graphs", None) is not None and worker.config.device.type == "cuda"
        self._exit = os._exit
        if processes:
            threading.Thread(target=self._watch, daemon=True, name="tp-watchdog").start()
        atexit.register(self.shutdown)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["runner"], name)

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        ready = wait(list(sentinels))
        if self._closing:
            return
        rank = sentinels[ready[0]]
        proc = self.processes[rank - 1]
        proc.join(0.1)
        self._dead = f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        logger.error("%s: the engine stops", self._dead)
        if self._may_hang:
            self._guard_hang()

    def _guard_hang(self) -> None:
        """A step in flight that neither fails nor finishes within HANG_GRACE_S waits in a captured collective
        that cannot time out: exit the process rather than hang (the server then reports the core's exit)."""
        deadline = time.monotonic() + HANG_GRACE_S
        while time.monotonic() < deadline:
            if self._seen.is_set() or self._closing or self._inflight == 0:
                return
            time.sleep(0.05)
        logger.critical("%s while a step was waiting on it inside a CUDA graph (captured collectives cannot time "
                        "out): exiting", self._dead)
        self._exit(1)

    def dead_reason(self) -> str | None:
        """Which worker rank exited and how (seen by the watchdog as it happens), or None."""
        return self._dead

    def _check(self) -> None:
        if self._closing:
            raise RuntimeError("the tensor-parallel engine was shut down")
        if self._dead is not None:
            self._seen.set()
            raise PeerFailure(self._dead)

    def launch(self, sched):
        self._check()
        self._inflight += 1
        try:
            comm.broadcast_object(("step", sched))
            return self.runner.launch(sched)
        except BaseException as e:
            self._inflight -= 1
            if isinstance(e, PeerFailure):
                raise self._failure(e) from e
            raise

    def collect(self, handle):
        try:
            return self.runner.collect(handle)
        except PeerFailure as e:
            raise self._failure(e) from e
        finally:
            self._inflight -= 1

    def execute(self, sched):
        return self.collect(self.launch(sched))

    def _failure(self, e: PeerFailure) -> PeerFailure:
        self._seen.set()
        for _ in range(20):       # the watchdog names the rank once its exit is seen (it is, within ~0.1 s)
            if self._dead is not None or not self.processes:
                break
            time.sleep(0.05)
        return PeerFailure(f"{self._dead}: {e}" if self._dead else str(e))

    def shutdown(self) -> None:
        """Stop every worker (a clean stop message if they are alive, then kill what is left) and leave the group."""
        if self._closing:
            return
        self._closing = True
        if self._dead is None:
            try:
                comm.broadcast_object(_STOP)
            except PeerFailure:
                pass
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        comm.destroy()


def start_tensor_parallel(config: WorkerConfig, size: int, *, expert_parallel: bool = False) -> TensorParallelRunner:
    """Rank 0's side of start-up. Under torchrun (WORLD_SIZE in the environment) the other ranks are the other
    torchrun processes (they call `run_torchrun_worker`); otherwise spawn them here."""
    processes = []
    if config.device.type == "cuda":
        first, count = config.device.index or 0, torch.cuda.device_count()
        if first + size > count:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs from cuda:{first}; {count} visible")
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        if int(os.environ["WORLD_SIZE"]) != size:
            raise ValueError(f"tensor_parallel_size {size} differs from torchrun's WORLD_SIZE "
                             f"{os.environ['WORLD_SIZE']}")
        init_method = None
    else:
        init_method = f"tcp://127.0.0.1:{comm.free_port()}"
        ctx = torch.multiprocessing.get_context("spawn")
        for rank in range(1, size):
            rank_config = dataclasses.replace(config, parallel=Parallel(rank, size, expert_parallel),
                                              device=rank_device(config.device, rank))
            p = ctx.Process(target=_worker_main, name=f"deltaserve-tp{rank}", daemon=True,
                            args=(rank_config, init_method, os.getpid(), torch.get_num_threads(),
                                  forced_graph_sizes))
            p.start()
            processes.append(p)
    try:
        comm.init_distributed(Parallel(0, size, expert_parallel), config.device, init_method=init_method)
        worker = _start_rank(dataclasses.replace(config, parallel=Parallel(0, size, expert_parallel)),
                             forced_graph_sizes)
    except BaseException as e:
        for p in processes:
            p.kill()
            p.join(1.0)
        comm.destroy()
        dead = [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(processes, 1) if p.exitcode]
        if dead and isinstance(e, (PeerFailure, RuntimeError)):
            raise PeerFailure(f"tensor-parallel start-up failed ({'; '.join(dead)}): {e}") from e
        raise
    return TensorParallelRunner(worker, processes)


def run_torchrun_worker(config: WorkerConfig, *, expert_parallel: bool = False) -> None:
    """A torchrun rank other than 0: join the group (env://), load the shard, run the broadcast steps."""
    parallel = comm.env_parallel(expert_parallel)
    device = rank_device(config.device, int(os.environ.get("LOCAL_RANK", parallel.rank)))
    config = dataclasses.replace(config, parallel=parallel, device=device)
    comm.init_distributed(parallel, device)
    try:
        serve_steps(_start_rank(config))
    finally:
        comm.destroy()
