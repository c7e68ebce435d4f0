"""Training and evaluation batches, sharded over ranks, on the training device.

Two loaders behind one interface (``Batches``):

- ``TensorBatches``: the whole split as a uint8 tensor (decoded once, see
  ``_archive``); every step gathers a batch, moves it to the device, and augments
  it there as one tensor (random crop after zero padding, horizontal flip,
  normalisation, timm's ``RandomErasing`` on the batch). On 2 CPU cores this is
  what makes CIFAR-scale training affordable: no JPEG decoding per epoch.
- ``FolderBatches``: timm's ``ImageDataset`` with timm's ``create_transform``
  (DeiT's train transform, random erasing included) behind a ``DataLoader`` with
  workers and a ``DistributedSampler``.

Each rank gets its own shard of every global batch (``batch_size // world``) and
mixes it itself. Evaluation shards are disjoint and unpadded, so all-reduced
counts cover every test image exactly once.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, Subset

from benchmarks._archive import TensorSplit
from mixlabels.score_maps import CropParams

__all__ = ["Batches", "TensorBatches", "FolderBatches", "Shard", "subset_indices"]


@dataclass(frozen=True)
class Shard:
    """This process's place among the ranks, and where its batches go."""

    rank: int
    world: int
    device: torch.device


class Batches(Protocol):
    """Batches of one split for one rank: ``(images (b, 3, H, W) float, labels (b,) long)`` on the device."""

    per_rank: int  # batch size on this rank

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        ...

    def epoch(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        """This rank's batches of ``epoch`` (the order depends on the seed and the epoch)."""
        ...


def subset_indices(n: int, subset: int | None) -> Tensor:
    """A fixed (seed-independent) random subset of ``range(n)``, sorted; all of it when ``subset`` is None."""
    if subset is None or subset >= n:
        return torch.arange(n)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1234))
    return perm[:subset].sort().values


def _per_rank(batch_size: int, world: int) -> int:
    if batch_size < 2 * world:
        raise ValueError(
            f"the global batch size {batch_size} is too small for {world} ranks: each rank mixes its own shard "
            f"and needs at least 2 images; use --batch-size {2 * world} or more"
        )
    if batch_size % world:
        raise ValueError(f"the global batch size {batch_size} must be divisible by the number of ranks {world}")
    per_rank = batch_size // world
    if per_rank % 2:
        raise ValueError(f"each rank's batch ({per_rank}) must be even for pairwise mixing")
    return per_rank


class TensorBatches:
    """Augmented batches gathered from a uint8 tensor split (see the module docstring).

    Args:
        split: the decoded split.
        indices: which images of the split to use (a subset).
        batch_size: global batch size (training) or per-rank batch size (evaluation).
        shard: rank, world size and device.
        train: shuffle, drop the last partial batch, augment.
        seed: seeds the order and the augmentation draws.
        mean, std: per-channel normalisation.
        crop_padding, hflip: the light augmentation of small images.
        erasing: timm's ``RandomErasing`` (applied in place to the normalised batch), or None.
    """

    def __init__(
        self,
        split: TensorSplit,
        indices: Tensor,
        batch_size: int,
        shard: Shard,
        *,
        train: bool,
        seed: int,
        mean: tuple[float, float, float],
        std: tuple[float, float, float],
        crop_padding: int = 4,
        hflip: float = 0.5,
        erasing: Any = None,
    ) -> None:
        self.images = split.images
        self.labels = split.labels
        self.indices = indices
        self.shard = shard
        self.train = train
        self.seed = seed
        self.per_rank = _per_rank(batch_size, shard.world) if train else batch_size
        self.mean = torch.tensor(mean, device=shard.device).view(1, 3, 1, 1)
        self.std = torch.tensor(std, device=shard.device).view(1, 3, 1, 1)
        self.crop_padding = crop_padding
        self.hflip = hflip
        self.erasing = erasing
        self._gen = torch.Generator().manual_seed(seed * 1_000_003 + shard.rank)

    def __len__(self) -> int:
        n = len(self.indices)
        if self.train:
            return n // (self.per_rank * self.shard.world)
        mine = len(range(self.shard.rank, n, self.shard.world))
        return -(-mine // self.per_rank)

    def _order(self, epoch: int) -> Tensor:
        if not self.train:
            return self.indices[self.shard.rank :: self.shard.world]
        perm = torch.randperm(len(self.indices), generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
        usable = len(self) * self.per_rank * self.shard.world
        grid = perm[:usable].view(-1, self.shard.world, self.per_rank)[:, self.shard.rank]  # steps, per_rank
        return self.indices[grid.reshape(-1)]

    def epoch(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        for x, y, _, _ in self.indexed_epoch(epoch):
            yield x, y

    def indexed_epoch(self, epoch: int) -> Iterator[tuple[Tensor, Tensor, Tensor, CropParams]]:
        """``epoch``'s batches with each image's split index and its crop and flip (what token labels align to).

        The crop boxes are in pixels of the original image (zero padding reaches past it);
        evaluation batches get the identity crop.
        """
        order = self._order(epoch)
        for start in range(0, len(order), self.per_rank):
            idx = order[start : start + self.per_rank]
            x = self.images[idx].to(self.shard.device, non_blocking=True).permute(0, 3, 1, 2)  # b 3 H W uint8
            y = self.labels[idx].to(self.shard.device, non_blocking=True)
            x = x.float().div_(255.0)
            params = self._sample_crops(x.shape[0], x.shape[2], x.shape[3])
            if self.train:
                x = self._augment(x, params)
            x = (x - self.mean) / self.std
            if self.train and self.erasing is not None:
                x = self.erasing(x)
            yield x, y, idx, params

    def _sample_crops(self, b: int, h: int, w: int) -> CropParams:
        """Each sample's crop offset in the zero-padded image and its flip (identity when not training)."""
        p = self.crop_padding if self.train else 0
        # the draw order (dy, dx, flips) is the loader's since its first version: same seed, same batches
        dy = torch.randint(0, 2 * p + 1, (b,), generator=self._gen) if p else torch.zeros(b, dtype=torch.long)
        dx = torch.randint(0, 2 * p + 1, (b,), generator=self._gen) if p else torch.zeros(b, dtype=torch.long)
        if self.train and self.hflip > 0:
            flips = torch.rand(b, generator=self._gen) < self.hflip
        else:
            flips = torch.zeros(b, dtype=torch.bool)
        x0, y0 = (dx - p).float(), (dy - p).float()
        boxes = torch.stack([x0, y0, x0 + w, y0 + h], dim=1)
        return CropParams(boxes, flips, torch.tensor([h, w]).expand(b, 2).clone())

    def _augment(self, x: Tensor, params: CropParams) -> Tensor:
        """Apply the sampled crops (gathers from the zero-padded batch) and flips as whole-batch tensor ops."""
        b, _, h, w = x.shape
        p = self.crop_padding
        if p:
            padded = F.pad(x, (p, p, p, p))
            dx = (params.boxes[:, 0:1].long() + p).to(x.device)
            dy = (params.boxes[:, 1:2].long() + p).to(x.device)
            rows = (dy + torch.arange(h, device=x.device)).view(b, 1, h, 1).expand(b, 3, h, w + 2 * p)
            cols = (dx + torch.arange(w, device=x.device)).view(b, 1, 1, w).expand(b, 3, h, w)
            x = padded.gather(2, rows).gather(3, cols)  # b 3 h w: the crop at (dy, dx) of every sample
        if self.hflip > 0:
            x = torch.where(params.flips.to(x.device).view(b, 1, 1, 1), x.flip(3), x)
        return x


class FolderBatches:
    """Batches from an ImageFolder split through timm's transforms, a DataLoader and a DistributedSampler.

    Args:
        root: the split's directory (``<root>/<class>/<image>``).
        indices: which images to use (a subset), or None for all.
        batch_size: global batch size (training) or per-rank batch size (evaluation).
        shard: rank, world size and device.
        train: shuffle, drop the last partial batch, train transform.
        seed: seeds the sampler's order.
        transform: timm's ``create_transform(...)`` for this split.
        workers: DataLoader workers per rank.
    """

    def __init__(
        self,
        root: Path,
        indices: Tensor | None,
        batch_size: int,
        shard: Shard,
        *,
        train: bool,
        seed: int,
        transform: Any,
        workers: int,
    ) -> None:
        from timm.data.dataset import ImageDataset

        dataset: Any = ImageDataset(str(root), transform=transform)  # type: ignore[no-untyped-call]
        if indices is not None:
            dataset = Subset(dataset, indices.tolist())
        self.shard = shard
        self.train = train
        per_rank = _per_rank(batch_size, shard.world) if train else batch_size
        self.per_rank = per_rank
        if train:
            self.sampler: DistributedSampler[Any] | None = DistributedSampler(
                dataset, num_replicas=shard.world, rank=shard.rank, shuffle=True, seed=seed, drop_last=True
            )
        else:
            self.sampler = None
            dataset = Subset(dataset, list(range(shard.rank, len(dataset), shard.world)))
        pin = shard.device.type == "cuda"
        self.loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_size=per_rank,
            sampler=self.sampler,
            shuffle=False,
            drop_last=train,
            num_workers=workers,
            pin_memory=pin,
            persistent_workers=workers > 0,
            worker_init_fn=_seed_worker,
            generator=torch.Generator().manual_seed(seed),
        )

    def __len__(self) -> int:
        return len(self.loader)

    def epoch(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
        for x, y in self.loader:
            yield x.to(self.shard.device, non_blocking=True), y.to(self.shard.device, non_blocking=True)


def _seed_worker(worker_id: int) -> None:
    # timm's RandomErasing and RandAugment draw from the python and numpy RNGs; give each worker its own stream
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    import numpy as np

    np.random.seed(seed)
