"""Run by ``test_timm_task.py`` under ``torchrun --nproc-per-node 2`` (gloo, CPU); prints rank 0's findings as JSON.

Three runs in one process group, each from the same initial weights and with different
data on each rank: the task without ``prepare_distributed`` (must refuse), the bare
adapter with its guard switched off (the negative control: the ranks must drift), and
the task after ``prepare_distributed`` with a step of gradient accumulation under
``no_sync`` (the ranks must stay identical).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from _dist_teardown import finish

import mixlabels
from mixlabels.backbones import FAMILIES, AlignedClassificationTask, adapt

_VIT = next(f for f in FAMILIES if f.name == "vit")  # a ViT, 32x32 images, 10 classes
from mixlabels.strategies import timm_mixup


def spread(params: list[torch.Tensor]) -> float:
    """Largest difference of any parameter between the two ranks."""
    flat = torch.cat([p.detach().flatten() for p in params])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return float((gathered[0] - gathered[1]).abs().max())


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, mixlabels.TokenLabelMap]]:
    g = torch.Generator().manual_seed(100 + rank)  # different data and draws on each rank
    mixer = timm_mixup(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=10, generator=g)
    out = []
    for _ in range(steps):
        images = torch.randn(4, 3, 32, 32, generator=g)
        labels = torch.randint(0, 10, (4,), generator=g)
        out.append(mixer(images, labels))
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    report: dict[str, Any] = {}
    data = batches(rank, 4)

    # 1. no prepare_distributed: the task refuses before any step
    task = AlignedClassificationTask(_VIT.example(), mixlabels.TLAlign(), verbose=False)
    try:
        task(*data[0])
        report["unprepared"] = None
    except RuntimeError as e:
        report["unprepared"] = str(e)
    # ... and the adapter beside a DDP of the bare model (the README pattern of old) refuses too
    model = _VIT.example()
    ddp_of_model = torch.nn.parallel.DistributedDataParallel(model)
    try:
        adapt(model, mixlabels.TLAlign())(*data[0])
        report["beside_ddp"] = None
    except RuntimeError as e:
        report["beside_ddp"] = str(e)
    del ddp_of_model

    # 2. negative control: the guard off, no DDP: plain SGD on different data drifts apart
    adapted = adapt(_VIT.example(), mixlabels.TLAlign())
    adapted.check_distributed = False
    report["start_spread"] = spread(list(adapted.parameters()))
    opt = torch.optim.SGD(adapted.parameters(), lr=0.1)
    for images, lm in data:
        opt.zero_grad()
        adapted(images, lm).loss().backward()
        opt.step()
    report["unsynced_spread"] = spread(list(adapted.parameters()))

    # 3. the task through DDP, as train.py drives it: accumulation of 2 micro-batches under no_sync
    task = AlignedClassificationTask(_VIT.example(), mixlabels.TLAlign(), verbose=False)
    task.prepare_distributed(device_ids=[torch.device("cpu")])  # what train.py passes on the CPU
    opt = torch.optim.SGD(task.get_trainable_module().parameters(), lr=0.1)
    losses = []
    for i, (images, lm) in enumerate(data):
        need_update = i % 2 == 1
        if not need_update:
            with task.no_sync():
                loss = task(images, lm)["loss"]
                loss /= 2  # train.py divides in place
                loss.backward()
        else:
            loss = task(images, lm)["loss"]
            loss /= 2
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach()))
    report["synced_spread"] = spread(list(task.get_eval_model().parameters()))
    report["losses_differ"] = bool(torch.tensor(losses).std() > 0)
    finish(report)


if __name__ == "__main__":
    main()
