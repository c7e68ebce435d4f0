"""One run of the ablation: train with DeiT's recipe through timm's factories, then evaluate top-1.

The loop is timm's (``train.py``) reduced to what the ablation varies: AdamW from
``create_optimizer_v2`` (no weight decay on biases, norms, position embedding and
class token), a per-step cosine schedule with linear warmup from
``create_scheduler_v2``, bf16 autocast on CUDA. Where timm calls
``mixup_fn(images, labels)`` and ``SoftTargetCrossEntropy``, a mixed run calls the
mixer for ``(mixed, label_map)`` and the adapted model for ``AlignedOutput``, whose
``loss()`` is the scheme's soft-target CE against stop-gradient targets. The
un-mixed row uses plain label-smoothed CE, as DeiT does without mixing.

Each rank mixes its own shard; DDP averages the gradients; top-1 counts are
all-reduced, so every rank returns the same result.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from mixlabels.backbones import adapt
from benchmarks._ablation_config import RunConfig
from benchmarks._data import Batches, Shard, TensorBatches
from benchmarks._token_labels import TokenLabelSource
from benchmarks._dist import all_reduce_sum
from mixlabels import NoAlign
from mixlabels.score_maps import CropParams

__all__ = ["RunResult", "train_and_evaluate", "seed_everything"]


@dataclass(frozen=True)
class RunResult:
    """What one finished run measured (identical on every rank)."""

    top1: float  # percent
    correct: int
    evaluated: int
    train_loss: float  # mean over the last tenth of the steps and the ranks
    steps: int
    train_seconds: float
    eval_seconds: float
    images_per_second: float


def seed_everything(seed: int, rank: int) -> None:
    """Same model init on every rank (DDP broadcasts it anyway); per-rank streams for augmentation."""
    torch.manual_seed(seed)
    random.seed(seed * 1_000_003 + rank)  # timm's RandomErasing draws from python's RNG


def _schedule(run: RunConfig, steps_per_epoch: int) -> int:
    if run.recipe.max_steps is not None:
        return run.recipe.max_steps
    if steps_per_epoch < 1:
        raise ValueError("the training set is smaller than one global batch; lower --batch-size or raise --subset")
    return max(1, math.ceil(run.recipe.epochs * steps_per_epoch))


def train_and_evaluate(
    run: RunConfig,
    train: Batches,
    test: Batches,
    shard: Shard,
    *,
    num_classes: int,
    progress: bool = False,
    desc: str = "",
    token_labels: TokenLabelSource | None = None,
    checkpoint: Path | None = None,
    init: Path | None = None,
) -> RunResult:
    """Train ``run`` (from scratch, or from ``run.model``'s init weights) on ``train``; return its top-1 on ``test``.

    Args:
        run: the run's configuration (model, recipe, mixer, scheme, seed).
        train: this rank's training batches (augmented, random erasing applied).
        test: this rank's evaluation shard.
        shard: rank, world size and device.
        num_classes: ``c``.
        progress: show a tqdm bar (rank 0 on a TTY).
        desc: the bar's label.
        token_labels: the annotator's score maps; every step's label map then carries the
            batch's aligned maps (``with_token_targets``), which the run's ``TokenLabeling``
            scheme mixes like the tokens into its token targets
            (``train`` must be ``TensorBatches``, which report each image's index and crop).
        checkpoint: where rank 0 saves the trained model's state dict (before evaluation).
        init: the weights to start from (the finetune profile's base checkpoint), replacing ``run.model.init``;
            the run's key names them through ``run.base``.
    """
    # the defining modules: timm's package __init__ files re-export without __all__, which mypy --strict refuses
    from timm.optim._optim_factory import create_optimizer_v2
    from timm.scheduler.scheduler_factory import create_scheduler_v2

    seed_everything(run.seed, shard.rank)
    recipe = run.recipe
    start_from = run.model if init is None else run.model.model_copy(update={"init": str(init)})
    model = start_from.initialised(num_classes).to(shard.device)  # random, or --init / --pretrained / base weights
    # same init on every rank (above); from here, per-rank streams so that stochastic depth differs across shards
    torch.manual_seed(run.seed * 1_000_003 + shard.rank)
    if token_labels is not None and (run.mixer is None or not isinstance(train, TensorBatches)):
        raise ValueError(f"{desc}: annotator token labels need a mixer and the tensor loader (--loader tensor)")
    net: nn.Module = model
    mixer = None
    if run.mixer is not None:
        mixer = run.mixer.build()
        mixer.generator = torch.Generator().manual_seed(run.seed * 1_000_003 + 7919 * shard.rank + 1)
        net = adapt(model, run.scheme.build() if run.scheme is not None else NoAlign())
    if shard.world > 1:
        net = DistributedDataParallel(net)  # device_ids=None: the label map is not a tensor DDP could scatter

    total = _schedule(run, len(train))
    optimizer = create_optimizer_v2(model, opt=recipe.opt, lr=recipe.lr, weight_decay=recipe.weight_decay)
    scheduler, _ = create_scheduler_v2(
        optimizer,
        sched="cosine",
        num_epochs=total,
        warmup_epochs=int(round(recipe.warmup * total)),
        warmup_lr=recipe.warmup_lr,
        min_lr=recipe.min_lr,
        step_on_epochs=False,  # counted in optimizer steps: one "epoch" of the schedule is one update
        updates_per_epoch=1,
    )
    autocast = torch.autocast(device_type=shard.device.type, dtype=torch.bfloat16, enabled=run.bf16)

    losses: list[Tensor] = []
    bar = tqdm(total=total, desc=desc, disable=not progress, leave=False, dynamic_ncols=True, position=1)
    net.train()
    step, epoch = 0, 0
    start = time.perf_counter()
    while step < total:
        for images, labels, indices, crops in _batches(train, epoch, indexed=token_labels is not None):
            maps = None
            if token_labels is not None and crops is not None:
                maps = token_labels.targets(indices, crops)  # this batch's score maps, aligned to its crops and flips
            if mixer is None:
                with autocast:
                    loss = F.cross_entropy(net(images), labels, label_smoothing=recipe.label_smoothing)
            else:
                mixed, label_map = mixer(images, labels)
                if maps is not None:  # they travel with the batch; the label map mixes them like the tokens
                    label_map = label_map.with_token_targets(maps)
                with autocast:
                    loss = net(mixed, label_map).loss()
            optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            if recipe.clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad)
            optimizer.step()
            step += 1
            scheduler.step_update(num_updates=step)
            losses.append(loss.detach().float())
            if step % 25 == 0 or step == total:
                value = float(loss.detach())  # one host sync every 25 steps
                if not math.isfinite(value):
                    raise FloatingPointError(f"{desc}: the training loss became {value} at step {step}")
                bar.set_postfix(loss=f"{value:.3f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}", refresh=False)
            bar.update()
            if step >= total:
                break
        epoch += 1
    if shard.device.type == "cuda":
        torch.cuda.synchronize(shard.device)
    train_seconds = time.perf_counter() - start
    bar.close()

    if checkpoint is not None and shard.rank == 0:
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = checkpoint.with_name(f".{checkpoint.name}.tmp")
        torch.save(model.state_dict(), tmp)
        tmp.replace(checkpoint)  # atomic: a checkpoint file is always whole
    tail = torch.stack(losses[-max(1, total // 10) :]).mean().view(1).double()
    train_loss = float(all_reduce_sum(tail)) / shard.world
    start = time.perf_counter()
    correct, evaluated = evaluate(model, test, autocast)
    eval_seconds = time.perf_counter() - start
    return RunResult(
        top1=100.0 * correct / max(1, evaluated),
        correct=correct,
        evaluated=evaluated,
        train_loss=train_loss,
        steps=total,
        train_seconds=train_seconds,
        eval_seconds=eval_seconds,
        images_per_second=total * train.per_rank * shard.world / max(train_seconds, 1e-9),
    )


def _batches(train: Batches, epoch: int, *, indexed: bool) -> Iterator[tuple[Tensor, Tensor, Tensor, CropParams | None]]:
    """``(images, labels, split indices, crops)``; indices and crops only from an indexed ``TensorBatches``."""
    if indexed and isinstance(train, TensorBatches):
        yield from train.indexed_epoch(epoch)
        return
    empty = torch.empty(0, dtype=torch.long)
    for images, labels in train.epoch(epoch):
        yield images, labels, empty, None


def evaluate(model: nn.Module, test: Batches, autocast: torch.autocast) -> tuple[int, int]:
    """Top-1 counts ``(correct, evaluated)`` summed over every rank's disjoint shard."""
    model.eval()
    device = next(model.parameters()).device
    counts = torch.zeros(2, dtype=torch.long, device=device)
    with torch.inference_mode(), autocast:
        for images, labels in test.epoch(0):
            counts[0] += (model(images).argmax(dim=-1) == labels).sum()
            counts[1] += labels.numel()
    counts = all_reduce_sum(counts.clone())
    return int(counts[0]), int(counts[1])
