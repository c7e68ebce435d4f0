"""Per-token targets of a mixed batch from its images' aligned score maps (Token Labeling's annotator)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange, reduce
from torch import Tensor

from mixlabels._label_map import TokenLabelMap

__all__ = ["DenseTokenAnnotator"]


@dataclass(frozen=True, eq=False)
class DenseTokenAnnotator:
    """Per-token targets from aligned score maps, mixed like the batch (a ``TokenAnnotator``).

    Holds each un-mixed sample's aligned targets and, called with a batch's label map,
    gives every token ``sum_k w_k * targets[source_k]`` at that token, ``w`` the map's
    exact token weights (Token Labeling Eq. 6 for MixToken's binary mask). The label
    map's ``label_smoothing`` ``s`` is applied as to soft labels: ``(1 - s) y + s / c``.

    Args:
        targets: ``(b, h, w, c)`` (from ``align_score_maps``) or ``(b, h*w, c)`` with ``grid``.
        grid: ``(h, w)``, needed for 3-d targets.

    Example:
        >>> from mixlabels import TokenLabeling
        >>> aligned = torch.softmax(torch.randn(2, 4, 4, 10), dim=-1)  # align_score_maps(...)
        >>> scheme = TokenLabeling(beta=0.5, annotator=DenseTokenAnnotator(aligned))
        >>> lm = TokenLabelMap.unmixed(torch.tensor([1, 2]), num_classes=10, image_size=(16, 16))
        >>> tuple(scheme.annotator(lm, (4, 4)).shape)
        (2, 16, 10)
    """

    targets: Tensor
    grid: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        t = self.targets
        if t.ndim == 4:
            object.__setattr__(self, "grid", (int(t.shape[1]), int(t.shape[2])))
            object.__setattr__(self, "targets", rearrange(t, "b h w c -> b (h w) c"))
        elif t.ndim != 3 or self.grid is None or self.grid[0] * self.grid[1] != t.shape[1]:
            raise ValueError(
                f"targets must be (b, h, w, c), or (b, h*w, c) with grid=(h, w); got {tuple(t.shape)} and grid={self.grid}"
            )

    def __call__(self, label_map: TokenLabelMap, grid: tuple[int, int]) -> Tensor:
        assert self.grid is not None
        (th, tw), (h, w) = self.grid, grid
        if self.targets.shape[0] != label_map.batch_size or self.targets.shape[2] != label_map.num_classes:
            raise ValueError(
                f"annotator targets {tuple(self.targets.shape)} do not fit a batch of {label_map.batch_size} "
                f"with {label_map.num_classes} classes"
            )
        targets = self.targets.to(label_map.device, torch.float32)
        if (th, tw) != (h, w):  # a coarser model grid: average the cells exactly
            if th % h or tw % w:
                raise ValueError(f"annotator targets on a {th}x{tw} grid cannot serve a {h}x{w} token grid")
            targets = reduce(targets, "b (h ph w pw) c -> b (h w) c", "mean", h=h, ph=th // h, w=w, pw=tw // w)
        weights = label_map.token_weights(grid)  # b n k
        mixed = torch.einsum("bknc,bnk->bnc", targets[label_map.sources], weights)
        s = label_map.label_smoothing
        return mixed * (1.0 - s) + s / label_map.num_classes if s else mixed
