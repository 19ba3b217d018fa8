"""Process groups and the collectives the sharded model and the step broadcast use.

`init_distributed` starts torch.distributed (NCCL on CUDA, gloo on CPU) from torchrun's env:// variables or
from an explicit address (spawned workers), with a timeout on every collective, plus a gloo group with no
practical timeout for the step plans (a worker waits there while the engine is idle; a dead peer still
breaks it at once through the closed connection). A collective that fails or times out raises
`PeerFailure`, never hangs.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from .parallel import Parallel

DEFAULT_TIMEOUT_S = 60.0            # a model collective (every rank runs the same step: waits are short)
PLAN_TIMEOUT = datetime.timedelta(days=365)

_plan_group = None


class PeerFailure(RuntimeError):
    """A collective failed: another rank died, or did not reach the collective in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(parallel: Parallel, device: torch.device, *, init_method: str | None = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the group (init_method None: env://, torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)."""
    global _plan_group
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=init_method or "env://", rank=parallel.rank,
                            world_size=parallel.size, timeout=datetime.timedelta(seconds=timeout_s))
    _plan_group = dist.new_group(backend="gloo", timeout=PLAN_TIMEOUT)


def env_parallel(expert_parallel: bool = False) -> Parallel:
    """This process's place under torchrun (RANK, WORLD_SIZE)."""
    return Parallel(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), expert_parallel)


def destroy() -> None:
    global _plan_group
    if dist.is_initialized():
        with contextlib.suppress(Exception):   # a peer already gone: nothing left to tear down cleanly
            dist.destroy_process_group()
    _plan_group = None


def _checked(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, dist.DistBackendError) as e:  # gloo / NCCL: closed connection, timeout
        raise PeerFailure(f"{what} failed: a tensor-parallel peer died or stopped responding ({e})") from e


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks, in place (returns x)."""
    _checked("all_reduce", dist.all_reduce, x)
    return x


def warm_up(device: torch.device) -> None:
    """One all-reduce on the device, waited for: NCCL creates its communicator at the first collective, which
    must not happen inside a CUDA-graph capture."""
    x = torch.ones(1, device=device)
    all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_reduce_min(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    _checked("all_reduce(min)", dist.all_reduce, t, op=dist.ReduceOp.MIN, group=_plan_group)
    return int(t.item())


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' tensors concatenated along `dim`, in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    _checked("all_gather", dist.all_gather, parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's `obj` (plain picklable objects: the step plans) on every rank, over the gloo plan group."""
    box = [obj]
    _checked("broadcast of the step plan", dist.broadcast_object_list, box, src=0, group=_plan_group)
    return box[0]
