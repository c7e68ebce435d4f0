"""Random and block-wise cell mixing (TL-Align, Table 7 and Appendix B).

The paper replaces the masking of MAE (random patches) and BEiT (block-wise) with
mixing on 16x16 cells. The ratio of cells taken from the partner follows the
official TL-Align code's random mixing (``tokenmix_mask_and_lam``):
``lam ~ Beta(alpha, alpha)``, ``floor((1 - lam) * n)`` cells come from the partner,
and the label uses the exact cell count. ``alpha = 1`` (a uniform ratio, CutMix's
default) is the default; ``ratio`` fixes the fraction instead (MAE: 0.75, BEiT: 0.4).

Shapes: ``g`` groups (independent draws), ``gh gw`` cell grid, ``n = gh * gw``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import Tensor

from mixlabels.strategies._base import MixParams, PairMixer
from mixlabels.strategies._cutmix import grid_of
from mixlabels.strategies._mixup import check_alpha
from mixlabels.strategies._sampling import MixSampler, Mode, Pairing, Pairs, sample_beta, sample_uniform

__all__ = ["CellParams", "RandomPatchMix", "BlockwiseMix", "RandomCellSampler", "BlockCellSampler"]


@dataclass(frozen=True, eq=False, kw_only=True)
class CellParams(MixParams):
    """Cell-mixing draws: which cells of the grid come from the partner.

    Attributes:
        cells: ``(b, gh, gw)`` bool, True where the cell is the partner's; all False where unmixed.
        grid: ``(gh, gw)``.
    """

    cells: Tensor
    grid: tuple[int, int]

    def source_weight(self) -> Tensor:
        return (~self.cells).float()

    def keep_cells(self) -> Tensor:
        return ~self.cells


class _CellSampler(MixSampler[CellParams]):
    """Shared part: the cell grid and the number of partner cells per group."""

    params_type = CellParams
    host_draws = True

    def __init__(self, cell_size: int, alpha: float, ratio: float | None, mode: Mode, pairing: Pairing, prob: float) -> None:
        check_alpha(alpha)
        if cell_size < 1:
            raise ValueError(f"cell_size must be a positive number of pixels, got {cell_size}")
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must lie in [0, 1] (the fraction of cells from the partner), got {ratio}")
        super().__init__(mode, pairing, prob)
        self.cell_size = int(cell_size)
        self.alpha = float(alpha)
        self.ratio = ratio

    def __repr__(self) -> str:
        return f"cell_size={self.cell_size}, alpha={self.alpha}, ratio={self.ratio}, {super().__repr__()}"

    def check_image_size(self, image_size: tuple[int, int]) -> None:
        super().check_image_size(image_size)
        grid_of(image_size, self.cell_size, "cell_size")

    def partner_counts(self, g: int, n: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
        """``(g,)`` long number of cells to take from the partner: ``floor((1 - lam) * n)``."""
        if self.ratio is not None:
            return torch.full((g,), math.floor(self.ratio * n), dtype=torch.long, device=device)
        lam = sample_beta(self.alpha, g, generator, device)
        return torch.floor((1.0 - lam.double()) * n).long()

    def cells_for(self, g: int, grid: tuple[int, int], counts: Tensor, generator: torch.Generator | None, device: torch.device) -> Tensor:
        raise NotImplementedError

    def draw(self, pairs: Pairs, image_size: tuple[int, int], generator: torch.Generator | None, device: torch.device) -> CellParams:
        grid = grid_of(image_size, self.cell_size, "cell_size")
        counts = self.partner_counts(pairs.num_groups, grid[0] * grid[1], generator, device)
        cells = self.cells_for(pairs.num_groups, grid, counts, generator, device)[pairs.group]
        cells = cells & pairs.applied[:, None, None]
        return CellParams(partner=pairs.partner, applied=pairs.applied, image_size=image_size, cells=cells, grid=grid)


class RandomCellSampler(_CellSampler):
    """MAE-style: exactly ``count`` cells chosen uniformly at random, via the ranks of random noise."""

    def cells_for(self, g: int, grid: tuple[int, int], counts: Tensor, generator: torch.Generator | None, device: torch.device) -> Tensor:
        noise = sample_uniform((g, grid[0] * grid[1]), generator, device)
        ranks = noise.argsort(dim=1).argsort(dim=1)  # a uniformly random order of the cells
        cells = ranks < counts[:, None]
        return rearrange(cells, "g (gh gw) -> g gh gw", gh=grid[0])


class BlockCellSampler(_CellSampler):
    """BEiT-style block-wise cells: random rectangles until the count is reached.

    BEiT's ``MaskingGenerator``, vectorised over groups: each step every unfinished
    group draws one rectangle (area uniform in ``[min_cells, remaining]``, log-uniform
    aspect ratio, strictly smaller than the grid); it is kept if it adds between 1 and
    ``remaining`` new cells. As in BEiT a group stops after 10 consecutive rejected
    draws, so the count can fall a few cells short; the label uses the cells mixed.
    The loop runs over draws (bounded), never over samples.
    """

    def __init__(
        self,
        cell_size: int,
        alpha: float,
        ratio: float | None,
        min_cells: int,
        max_cells: int | None,
        min_aspect: float,
        max_aspect: float | None,
        mode: Mode,
        pairing: Pairing,
        prob: float,
    ) -> None:
        super().__init__(cell_size, alpha, ratio, mode, pairing, prob)
        max_aspect = 1.0 / min_aspect if max_aspect is None and min_aspect > 0 else max_aspect
        if not (min_aspect > 0 and max_aspect is not None and max_aspect >= min_aspect):
            raise ValueError(f"aspect ratios must satisfy 0 < min_aspect <= max_aspect, got {min_aspect}, {max_aspect}")
        if min_cells < 1 or (max_cells is not None and max_cells < 1):
            raise ValueError(f"min_cells and max_cells must be >= 1 (cells per block), got {min_cells}, {max_cells}")
        self.min_cells = int(min_cells)
        self.max_cells = max_cells
        self.log_aspect = (math.log(min_aspect), math.log(max_aspect))

    def __repr__(self) -> str:
        return f"min_cells={self.min_cells}, max_cells={self.max_cells}, {super().__repr__()}"

    def check_image_size(self, image_size: tuple[int, int]) -> None:
        super().check_image_size(image_size)
        gh, gw = grid_of(image_size, self.cell_size, "cell_size")
        # A block is strictly smaller than the grid (BEiT), so no block exceeds (gh - 1) x (gw - 1)
        # cells; a larger min_cells would reject every draw and leave every sample unmixed in silence.
        most = (gh - 1) * (gw - 1)
        if self.min_cells > most:
            raise ValueError(
                f"min_cells={self.min_cells} cannot fit on the {gh}x{gw} cell grid of {image_size[0]}x{image_size[1]} "
                f"images: a block is strictly smaller than the grid, so it has at most {most} cells; lower min_cells "
                "or cell_size, or use larger images"
            )

    def cells_for(self, g: int, grid: tuple[int, int], counts: Tensor, generator: torch.Generator | None, device: torch.device) -> Tensor:
        gh, gw = grid
        rows = torch.arange(gh, device=device)
        cols = torch.arange(gw, device=device)
        cells = torch.zeros(g, gh, gw, dtype=torch.bool, device=device)
        done = torch.zeros(g, dtype=torch.long, device=device)
        fails = torch.zeros(g, dtype=torch.long, device=device)
        cap = self.max_cells if self.max_cells is not None else gh * gw
        # Each kept rectangle adds >= 1 cell and at most 10 draws are rejected in a row,
        # so 10 * (n + 1) steps always suffice.
        for step in range(10 * (gh * gw + 1)):
            active = (done < counts) & (fails < 10)
            if step % 8 == 0 and not bool(active.any()):  # one host sync every 8 draws
                break
            room = torch.clamp(counts - done, max=cap).double()
            u = sample_uniform((g, 4), generator, device)
            area = self.min_cells + u[:, 0] * (room - self.min_cells)  # random.uniform(a, b) allows a > b
            aspect = torch.exp(self.log_aspect[0] + u[:, 1] * (self.log_aspect[1] - self.log_aspect[0]))
            h = torch.round(torch.sqrt(area * aspect)).long()  # round half to even, as Python's round
            w = torch.round(torch.sqrt(area / aspect)).long()
            fits = (h < gh) & (w < gw)
            top = torch.floor(u[:, 2] * (gh - h + 1).clamp(min=1)).long()
            left = torch.floor(u[:, 3] * (gw - w + 1).clamp(min=1)).long()
            in_rows = (rows >= top[:, None]) & (rows < (top + h)[:, None])
            in_cols = (cols >= left[:, None]) & (cols < (left + w)[:, None])
            rect = in_rows[:, :, None] & in_cols[:, None, :]
            new = (rect & ~cells).sum(dim=(1, 2))
            keep = active & fits & (new > 0) & (new <= room.long())
            cells = cells | (rect & keep[:, None, None])
            done = done + torch.where(keep, new, torch.zeros_like(new))
            fails = torch.where(keep, torch.zeros_like(fails), fails + active.long())
        return cells


class RandomPatchMix(PairMixer[CellParams]):
    """Random cell mixing (MAE-style masking as mixing): each cell comes from the partner or not.

    Exactly ``floor((1 - lam) * n)`` of the ``n`` cells come from the partner,
    ``lam ~ Beta(alpha, alpha)``; the map's mask is at cell resolution.

    Args:
        num_classes: ``c``.
        cell_size: cell side in pixels (the paper: 16); must divide the image.
        alpha: Beta(alpha, alpha) concentration of lambda (default 1: uniform ratio).
        ratio: fixed fraction of partner cells instead of a Beta draw (MAE masks 0.75).
        label_smoothing: in ``[0, 1)``.
        prob: probability of mixing, per batch, pair or sample according to ``mode``.
        mode: ``"batch"``, ``"pair"`` or ``"elem"``; samples sharing a draw share the cells.
        pairing: ``"flip"``, ``"derangement"`` or ``"roll"``.
        generator: default source of randomness.

    Example:
        >>> mixer = RandomPatchMix(num_classes=10, cell_size=4, ratio=0.25, generator=torch.Generator().manual_seed(0))
        >>> mixed, lm = mixer(torch.rand(2, 3, 16, 16), torch.tensor([3, 7]))
        >>> lm.mask.dense().shape, lm.image_weights[:, 0].tolist()
        (torch.Size([2, 2, 4, 4]), [0.75, 0.75])
    """

    def __init__(
        self,
        num_classes: int,
        cell_size: int = 16,
        alpha: float = 1.0,
        ratio: float | None = None,
        label_smoothing: float = 0.0,
        prob: float = 1.0,
        mode: Mode = "batch",
        pairing: Pairing = "flip",
        generator: torch.Generator | None = None,
    ) -> None:
        sampler = RandomCellSampler(cell_size, alpha, ratio, mode, pairing, prob)
        super().__init__(sampler, num_classes, label_smoothing, generator)


class BlockwiseMix(PairMixer[CellParams]):
    """Block-wise cell mixing (BEiT-style masking as mixing): rectangles of cells from the partner.

    Args:
        num_classes: ``c``.
        cell_size: cell side in pixels (the paper: 16); must divide the image.
        alpha: Beta(alpha, alpha) concentration of lambda; ``floor((1 - lam) * n)`` cells are targeted.
        ratio: fixed fraction of partner cells instead of a Beta draw (BEiT masks 0.4).
        min_cells: smallest block in cells (BEiT: 16).
        max_cells: largest block in cells (BEiT: the remaining count).
        min_aspect: smallest block aspect ratio (BEiT: 0.3); ``max_aspect`` defaults to its inverse.
        max_aspect: largest block aspect ratio.
        label_smoothing: in ``[0, 1)``.
        prob: probability of mixing, per batch, pair or sample according to ``mode``.
        mode: ``"batch"``, ``"pair"`` or ``"elem"``.
        pairing: ``"flip"``, ``"derangement"`` or ``"roll"``.
        generator: default source of randomness.

    Example:
        >>> mixer = BlockwiseMix(num_classes=10, cell_size=2, min_cells=4, generator=torch.Generator().manual_seed(0))
        >>> mixed, lm = mixer(torch.rand(4, 3, 16, 16), torch.tensor([1, 2, 3, 4]))
        >>> lm.mask.dense().shape
        torch.Size([4, 2, 8, 8])
    """

    def __init__(
        self,
        num_classes: int,
        cell_size: int = 16,
        alpha: float = 1.0,
        ratio: float | None = None,
        min_cells: int = 16,
        max_cells: int | None = None,
        min_aspect: float = 0.3,
        max_aspect: float | None = None,
        label_smoothing: float = 0.0,
        prob: float = 1.0,
        mode: Mode = "batch",
        pairing: Pairing = "flip",
        generator: torch.Generator | None = None,
    ) -> None:
        sampler = BlockCellSampler(cell_size, alpha, ratio, min_cells, max_cells, min_aspect, max_aspect, mode, pairing, prob)
        super().__init__(sampler, num_classes, label_smoothing, generator)
