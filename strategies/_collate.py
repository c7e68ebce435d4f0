"""CollateMixer: mix uint8 batches while collating, in DataLoader workers (timm's ``FastCollateMixup``).

timm's default training path keeps images uint8 until its ``PrefetchLoader`` moves
them to the device and normalises them there; mixing happens in the collate
function. ``CollateMixer(mixer)`` does the same with any mixer of this library and
returns ``(uint8 images, TokenLabelMap)``; the prefetcher moves both with
``.to(device, non_blocking=True)`` and normalises the images (mixing commutes with the
per-channel normalisation, up to the uint8 rounding of blends that timm has too).

It is a ``timm.data.FastCollateMixup`` for timm's sake only: ``PrefetchLoader.mixup_enabled``
(what ``--mixup-off-epoch`` sets) reaches the collate function through that type check.
The switch lives in shared memory, so persistent workers see it too.

Randomness: one generator per worker process, seeded from ``seed`` and the worker's own
seed (``torch.utils.data.get_worker_info().seed``, which torch draws afresh for every
epoch's workers from the loader's generator or the global RNG). Workers never repeat
each other's draws, and a run is reproducible when ``seed`` and torch's seed are fixed.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from timm.data.mixup import FastCollateMixup
from torch import Tensor
from torch.utils.data import default_collate, get_worker_info

from mixlabels import TokenLabelMap
from mixlabels.strategies._base import Mixer
from mixlabels.strategies._timm_mixup import timm_mixup

__all__ = ["CollateMixer", "timm_collate_mixup"]

_GOLDEN = 0x9E3779B97F4A7C15  # spreads (seed, worker seed) pairs over the 64-bit seed space
_CHANNELS = (1, 3, 4)  # grey, RGB, RGBA: the channel counts that tell (C, H, W) from (H, W, C)


def stack_uint8(batch: Sequence[tuple[Any, Any]]) -> tuple[Tensor, Tensor]:
    """``fast_collate``'s stacking: ``(b, c, H, W)`` uint8 images and the collated labels."""
    if not batch or not isinstance(batch[0], (tuple, list)) or len(batch[0]) != 2:
        raise ValueError("CollateMixer collates (image, label) samples; the dataset returned something else")
    first = batch[0][0]
    if isinstance(first, (tuple, list)):
        raise ValueError(
            "CollateMixer got a tuple of images per sample (AugMix splits, --aug-splits); collate-time mixing "
            "cannot de-interleave them (timm's FastCollateMixup refuses them too): drop --aug-splits"
        )
    images = [torch.from_numpy(x) if isinstance(x, np.ndarray) else x for x, _ in batch]
    if not all(isinstance(x, Tensor) and x.dtype == torch.uint8 and x.ndim == 3 for x in images):
        kinds = {f"{type(x).__name__} {getattr(x, 'dtype', '')} {tuple(getattr(x, 'shape', ()))}" for x, _ in batch}
        raise ValueError(
            f"CollateMixer mixes uint8 (channels, H, W) images (timm's prefetcher path, ToNumpy/MaybePILToTensor "
            f"transforms), got {sorted(kinds)}; for float batches call the mixer after the DataLoader instead"
        )
    shape = tuple(images[0].shape)
    if shape[-1] in _CHANNELS and shape[0] not in _CHANNELS:
        # (H, W, C), as np.asarray(PIL image) gives: stacked as (C, H, W) it would mix rows as channels.
        raise ValueError(
            f"CollateMixer got a channels-last {shape} uint8 image (height, width, channels, as np.asarray of a PIL "
            f"image gives); it mixes (channels, H, W) images. Make the transform end with timm's ToNumpy() or "
            f"MaybePILToTensor() (channels first), or transpose each image: np.transpose(x, (2, 0, 1)) / x.permute(2, 0, 1)"
        )
    labels = default_collate([y for _, y in batch])
    if isinstance(labels, Tensor) and labels.ndim == 1:
        labels = labels.long()  # class ids, whatever the dataset's integer type (as fast_collate)
    return torch.stack(images), labels


class CollateMixer(FastCollateMixup):  # the base is for timm's type check (PrefetchLoader.mixup_enabled)
    """A DataLoader ``collate_fn`` that mixes uint8 batches with ``mixer``: ``(images, label_map)``.

    Args:
        mixer: any mixer of this library (its own ``generator`` is not used: see the module docstring).
        seed: base seed of the per-worker generators; ``None`` takes the worker seeds alone
            (and torch's global RNG in the main process).

    Example:
        >>> from mixlabels.strategies import CutMix
        >>> collate = CollateMixer(CutMix(num_classes=10), seed=0)
        >>> batch = [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), i) for i in range(4)]
        >>> images, lm = collate(batch)
        >>> images.dtype, lm.image_targets().shape
        (torch.uint8, torch.Size([4, 10]))
    """

    def __init__(self, mixer: Mixer[Any], seed: int | None = None) -> None:
        # FastCollateMixup.__init__ is not called: the mixer holds the whole configuration.
        if not isinstance(mixer, Mixer):
            raise TypeError(f"CollateMixer needs a mixlabels mixer (MixUp, CutMix, Switch, ...), got {type(mixer).__name__}")
        self.mixer = mixer
        self.seed = seed
        self._enabled = torch.ones((), dtype=torch.bool).share_memory_()  # type: ignore[no-untyped-call]  # untyped in torch  # seen by already-started workers
        self._generator: torch.Generator | None = None
        self._generator_key: tuple[int, ...] | None = None

    @property
    def num_classes(self) -> int:
        return self.mixer.num_classes

    @property
    def mixup_enabled(self) -> bool:
        """timm's switch: ``False`` collates the images unmixed with the identity map."""
        return bool(self._enabled.item())

    @mixup_enabled.setter
    def mixup_enabled(self, value: bool) -> None:
        self._enabled.fill_(bool(value))

    def __repr__(self) -> str:
        return f"CollateMixer({self.mixer!r}, seed={self.seed})"

    def generator(self) -> torch.Generator | None:
        """This process's generator: per worker (and per epoch for non-persistent workers), or the main one."""
        info = get_worker_info()
        if info is None:
            if self.seed is None:
                return self.mixer.generator  # main process: the mixer's own source (None: global RNG)
            key: tuple[int, ...] = (-1,)
            seed = self.seed
        else:
            key = (info.id, info.seed)
            seed = info.seed if self.seed is None else (self.seed * _GOLDEN + info.seed) % 2**63
        if self._generator is None or self._generator_key != key:
            self._generator, self._generator_key = torch.Generator().manual_seed(seed), key
        return self._generator

    def mix(self, images: Tensor, labels: Tensor, params: Any) -> tuple[Tensor, TokenLabelMap]:
        """Mix uint8 ``images`` with ``params``: the mixer's float result, rounded as timm rounds (half to even)."""
        mixed = self.mixer.apply_images(images.float(), params)
        return torch.round(mixed).to(torch.uint8), self.mixer.label_map_from(params, labels)

    def __call__(self, batch: Sequence[tuple[Any, Any]], _: Any = None) -> tuple[Tensor, TokenLabelMap]:
        images, labels = stack_uint8(batch)
        self.mixer._check_labels(labels, int(images.shape[0]))
        if not self.mixup_enabled:
            return images, self.mixer.unmixed_map(labels, (int(images.shape[2]), int(images.shape[3])))
        params = self.mixer.sample(tuple(images.shape), generator=self.generator())
        return self.mix(images, labels, params)


def timm_collate_mixup(
    mixup_alpha: float = 1.0,
    cutmix_alpha: float = 0.0,
    cutmix_minmax: Sequence[float] | None = None,
    prob: float = 1.0,
    switch_prob: float = 0.5,
    mode: str = "batch",
    correct_lam: bool = True,
    label_smoothing: float = 0.1,
    num_classes: int = 1000,
    multi_label: bool = False,
    *,
    seed: int | None = None,
) -> CollateMixer:
    """timm's ``FastCollateMixup(**mixup_args)``: ``CollateMixer(timm_mixup(**mixup_args), seed)``.

    Example:
        >>> collate = timm_collate_mixup(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=10, seed=0)
        >>> type(collate.mixer).__name__
        'Switch'
    """
    mixer = timm_mixup(
        mixup_alpha, cutmix_alpha, cutmix_minmax, prob, switch_prob, mode, correct_lam, label_smoothing, num_classes,
        multi_label,
    )
    return CollateMixer(mixer, seed)
