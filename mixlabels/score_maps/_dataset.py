"""A dataset wrapper: each image random-resized-cropped and flipped, with its score map aligned to the same crop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from mixlabels.score_maps._crops import (
    CropParams,
    align_score_maps,
    check_crop_distribution,
    crop_resize,
    sample_resized_crops,
)
from mixlabels.score_maps._store import ScoreMaps
from mixlabels.score_maps._topk import Fill, ScoreMapError

__all__ = ["ScoreMapDataset"]


def _to_tensor(image: Any) -> Tensor:
    """``(3, H, W)`` float in [0, 1] from a PIL image, an ``(H, W, 3)`` uint8 array or a ``(3, H, W)`` tensor."""
    if isinstance(image, Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"a tensor image must be (3, H, W), got {tuple(image.shape)}")
        return image.float().div(255.0) if image.dtype == torch.uint8 else image.float()
    array = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
    if array.ndim != 3 or array.shape[2] != 3:
        raise ValueError(f"an image must be RGB (H, W, 3), got shape {array.shape}")
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div(255.0)  # 3 H W


class ScoreMapDataset(Dataset[tuple[Tensor, int, Tensor]]):
    """``(image, label, token targets)``: a random-resized crop and flip of each image and of its score map.

    Token Labeling (section 4.1) aligns an image's dense score map to the random crop
    the image got: the crop box is sampled once (``sample_resized_crops``, torchvision's
    ``RandomResizedCrop`` and a flip), crops the image to ``size`` and, with RoIAlign in
    map coordinates, the map to the token ``grid``.

    Args:
        images: a map-style dataset of ``(image, label)`` without geometric transforms
            (e.g. timm's ``ImageDataset`` or torchvision's ``ImageFolder`` with no
            transform): PIL images, ``(H, W, 3)`` uint8 arrays or ``(3, H, W)`` tensors.
        store: the score maps; store position ``positions[i]`` belongs to ``images[i]``.
        size: ``(h, w)`` of the output images.
        grid: ``(h, w)`` token grid of the model (e.g. 14x14 for patch 16 at 224 px).
        scale, ratio, hflip: the crop distribution (torchvision's defaults).
        fill: how the mass beyond the stored top-k is restored.
        transform: applied to the cropped ``(3, h, w)`` [0, 1] tensor (normalisation,
            colour); it must not move pixels, or the labels no longer follow them.
        positions: store position of each dataset index (default: the same index, which
            holds when both list ``<split>/<class>/<file>`` in ImageFolder order).
        generator: draws the crops (default: torch's global RNG, which a ``DataLoader``
            seeds per worker).

    Returns (per item):
        ``image`` ``(3, h, w)`` float, ``label`` int, ``targets`` ``(h_grid, w_grid, c)`` fp32
        distributions; a batch of targets goes to ``label_map.with_token_targets`` as it is.

    Example:
        >>> import tempfile
        >>> from mixlabels.score_maps import ScoreMapWriter, compress
        >>> tmp = tempfile.TemporaryDirectory()
        >>> with ScoreMapWriter(tmp.name, num_classes=4, map_size=(4, 4), k=2) as w:
        ...     w.append(["a", "b"], compress(torch.softmax(torch.randn(2, 4, 4, 4), -1), k=2))
        >>> data = [(torch.rand(3, 40, 48), 0), (torch.rand(3, 32, 32), 3)]
        >>> ds = ScoreMapDataset(data, ScoreMaps(tmp.name), size=(16, 16), grid=(2, 2))
        >>> image, label, targets = ds[1]
        >>> tuple(image.shape), label, tuple(targets.shape)
        ((3, 16, 16), 3, (2, 2, 4))
        >>> tmp.cleanup()
    """

    def __init__(
        self,
        images: Dataset[tuple[Any, int]] | Sequence[tuple[Any, int]],
        store: ScoreMaps,
        *,
        size: tuple[int, int],
        grid: tuple[int, int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        hflip: float = 0.5,
        fill: Fill = "renormalize",
        transform: Callable[[Tensor], Tensor] | None = None,
        positions: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        for name, pair in (("size", size), ("grid", grid)):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(s, int) and s > 0 for s in pair)):
                raise ValueError(f"{name} must be (height, width), two positive integers, got {pair!r}")
        if not isinstance(store, ScoreMaps):
            raise TypeError(f"store must be a ScoreMaps (ScoreMaps(directory)), got {type(store).__name__}")
        check_crop_distribution(scale, ratio, hflip)
        n = len(images)  # type: ignore[arg-type]  # map-style datasets define __len__
        if positions is None:
            if len(store) != n:
                raise ScoreMapError(
                    f"{store.root / 'index.json'} holds {len(store)} maps but the dataset has {n} images: "
                    "annotate the same split, or pass positions= mapping each image to its map"
                )
            positions = range(n)
        elif len(positions) != n or (n and not 0 <= min(positions) <= max(positions) < len(store)):
            raise ScoreMapError(f"positions must give each of the {n} images a map in [0, {len(store)})")
        self.images = images
        self.store = store
        self.size, self.grid = size, grid
        self.scale, self.ratio, self.hflip = scale, ratio, hflip
        self.fill = fill
        self.transform = transform
        self.positions = list(positions)
        self.generator = generator

    def __len__(self) -> int:
        return len(self.positions)

    def sample(self, image_size: tuple[int, int]) -> CropParams:
        """One crop and flip for an image of ``image_size`` ``(H, W)``."""
        return sample_resized_crops(image_size, 1, self.scale, self.ratio, self.hflip, generator=self.generator)

    def apply(self, image: Tensor, index: int, params: CropParams) -> tuple[Tensor, Tensor]:
        """The crop ``params`` of ``image`` (``(3, H, W)``) and of map ``index``: ``(3, h, w)``, ``(gh, gw, c)``."""
        x = crop_resize(image.unsqueeze(0), params, self.size, padding="zeros")[0]
        maps = self.store.get([self.positions[index]])
        targets = align_score_maps(maps, params, self.grid, fill=self.fill)[0]
        return x, targets

    def __getitem__(self, index: int) -> tuple[Tensor, int, Tensor]:
        raw, label = self.images[index]
        image = _to_tensor(raw)
        x, targets = self.apply(image, index, self.sample((int(image.shape[1]), int(image.shape[2]))))
        if self.transform is not None:
            x = self.transform(x)
        return x, int(label), targets
