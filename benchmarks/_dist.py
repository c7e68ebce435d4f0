"""torch.distributed for the ablation: env:// set-up under torchrun, rank-0 decisions, all-reduced counts.

Launched plainly, the job is one process (world 1) and nothing is initialised.
Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR`` set) it
joins the process group: gloo on the CPU, nccl on CUDA, one GPU per local rank.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from benchmarks._data import Shard

__all__ = ["setup", "teardown", "all_reduce_sum", "broadcast_from_zero", "barrier"]

T = TypeVar("T")


def setup(device: str) -> Shard:
    """Join the process group if launched by torchrun; return this rank's shard and device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
        dev = torch.device("cuda", local_rank if world > 1 or dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", init_method="env://")
    return Shard(rank=rank, world=world, device=dev)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum ``values`` over ranks (a no-op in a single process)."""
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def broadcast_from_zero(obj: T) -> T:
    """Rank 0's ``obj`` on every rank, so every rank takes the same decision (e.g. which runs are done)."""
    if not dist.is_initialized():
        return obj
    box: list[Any] = [obj]
    dist.broadcast_object_list(box, src=0)
    out: T = box[0]
    return out
