"""Top-k score maps: the compact form of an annotator's dense class distributions, and their reconstruction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["ScoreMapError", "TopKMaps", "Fill", "compress", "to_dense"]

Fill = Literal["renormalize", "spread", "zeros"]


class ScoreMapError(ValueError):
    """A score-map store that is not what its index says (the message names the file)."""


@dataclass(frozen=True, eq=False)
class TopKMaps:
    """Top-k scores of score maps: ``values`` fp16 (descending) and ``indices`` int16, ``(..., hm, wm, k)``.

    Example:
        >>> maps = torch.softmax(torch.randn(2, 4, 4, 10), dim=-1)
        >>> top = compress(maps, k=3)
        >>> top.values.dtype, top.indices.dtype, tuple(top.dense().shape)
        (torch.float16, torch.int16, (2, 4, 4, 10))
    """

    values: Tensor
    indices: Tensor
    num_classes: int

    @property
    def k(self) -> int:
        return int(self.values.shape[-1])

    def to(self, device: torch.device | str) -> TopKMaps:
        """The same maps on another device."""
        return TopKMaps(self.values.to(device), self.indices.to(device), self.num_classes)

    def __getitem__(self, items: Tensor | slice | int) -> TopKMaps:
        """The maps of some images (indexing the leading dimension)."""
        return TopKMaps(self.values[items], self.indices[items], self.num_classes)

    def dense(self, fill: Fill = "renormalize") -> Tensor:
        """``(..., hm, wm, c)`` fp32 distributions; see ``to_dense``."""
        return to_dense(self.values, self.indices, self.num_classes, fill)


def compress(scores: Tensor, k: int = 5) -> TopKMaps:
    """Keep the ``k`` largest scores of every map cell: fp16 values, int16 class ids.

    Args:
        scores: ``(..., hm, wm, c)`` class scores (probabilities) per map cell.
        k: how many to keep (``1 <= k <= c``).
    """
    c = int(scores.shape[-1])
    if not 1 <= k <= c:
        raise ValueError(f"k must lie in [1, num_classes={c}], got {k}")
    if c > torch.iinfo(torch.int16).max + 1:
        raise ValueError(f"class ids are stored as int16: at most 32768 classes, got {c}")
    values, indices = scores.float().topk(k, dim=-1)  # descending
    return TopKMaps(values.half(), indices.to(torch.int16), c)


def to_dense(values: Tensor, indices: Tensor, num_classes: int, fill: Fill = "renormalize") -> Tensor:
    """Dense ``(..., c)`` fp32 distributions from top-k ``values`` and class ``indices`` ``(..., k)``.

    Args:
        fill: ``"renormalize"`` (top-k scores over their sum), ``"spread"`` (the remaining
            mass shared evenly by the other classes) or ``"zeros"`` (raw scatter, unnormalised).
    """
    v = values.float()
    idx = indices.long()
    k = int(v.shape[-1])
    total = v.sum(dim=-1, keepdim=True)
    if fill == "spread" and num_classes > k:
        rest = (1.0 - total).clamp_min(0.0) / (num_classes - k)
        out = rest.expand(*v.shape[:-1], num_classes).clone().scatter_(-1, idx, v)
        return out / out.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    out = torch.zeros(*v.shape[:-1], num_classes, dtype=torch.float32, device=v.device).scatter_(-1, idx, v)
    if fill == "zeros":
        return out
    if fill not in ("renormalize", "spread"):
        raise ValueError(f"fill must be 'renormalize', 'spread' or 'zeros', got {fill!r}")
    return out / total.clamp_min(torch.finfo(torch.float32).tiny)


