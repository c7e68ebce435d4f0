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
import random
from array import array
from dataclasses import dataclass
from typing import ClassVar

import torch
from einops import rearrange
from torch import Tensor

from mixlabels.strategies._base import MixParams, PairMixer
from mixlabels.strategies._cutmix import grid_of
from mixlabels.strategies._mixup import check_alpha
from mixlabels.strategies._host_draws import HostPairs, column, columns_on, draw_beta, host_rng, sources_column, to_fp32
from mixlabels.strategies._sampling import MixSampler, Mode, Pairing

__all__ = ["CellParams", "CellMixer", "RandomPatchMix", "BlockwiseMix", "RandomCellSampler", "BlockCellSampler"]

_NOT = bytes.maketrans(b"\x00\x01", b"\x01\x00")  # a bool byte negated


@dataclass(frozen=True, eq=False, kw_only=True)
class CellParams(MixParams):
    """Cell-mixing draws: which cells of the grid come from the partner.

    Attributes:
        cells: ``(b, gh, gw)`` bool, True where the cell is the partner's; all False where unmixed.
        grid: ``(gh, gw)``.
        keep: ``~cells``, when the sampler sent it with its draws (no kernel to negate them);
            ``None``: computed from ``cells``.
    """

    cells: Tensor
    grid: tuple[int, int]
    keep: Tensor | None = None

    DERIVED: ClassVar[tuple[str, ...]] = (*MixParams.DERIVED, "keep")

    def source_weight(self) -> Tensor:
        return (~self.cells).float()

    def keep_cells(self) -> Tensor:
        return ~self.cells if self.keep is None else self.keep


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

    def partner_count(self, n: int, rng: random.Random) -> int:
        """Number of cells to take from the partner: ``floor((1 - lam) * n)``, lam rounded to fp32 as the params keep it."""
        if self.ratio is not None:
            return math.floor(self.ratio * n)
        return math.floor((1.0 - to_fp32(draw_beta(self.alpha, rng))) * n)

    def cells_of(self, count: int, grid: tuple[int, int], rng: random.Random) -> list[bool]:
        """One group's cells, row-major ``gh * gw``: True where the cell is the partner's."""
        raise NotImplementedError

    def cells_for(self, g: int, grid: tuple[int, int], counts: Tensor, generator: torch.Generator | None, device: torch.device) -> Tensor:
        """``(g, gh, gw)`` bool cells for ``(g,)`` host counts, drawn as ``cells_of`` draws them (tests, analyses)."""
        rng = host_rng(generator)
        rows = [self.cells_of(int(c), grid, rng) for c in counts.tolist()]
        return torch.tensor(rows, dtype=torch.bool, device=device).view(g, *grid)

    def draw_host(self, pairs: HostPairs, image_size: tuple[int, int], rng: random.Random, device: torch.device) -> CellParams:
        grid = grid_of(image_size, self.cell_size, "cell_size")
        n = grid[0] * grid[1]
        rows = [bytes(self.cells_of(self.partner_count(n, rng), grid, rng)) for _ in range(pairs.num_groups)]
        return host_cell_params(pairs, rows, image_size, grid, device)


def host_cell_params(
    pairs: HostPairs, rows: list[bytes], image_size: tuple[int, int], grid: tuple[int, int], device: torch.device,
) -> CellParams:
    """``CellParams`` of Python-drawn cells, one row-major ``gh * gw`` bytes per group (1: the partner's), with the
    label map's values, in one buffer on ``device``."""
    n = grid[0] * grid[1]
    # Every sample's cells, keep mask, label cells [w0, 1 - w0] and lambda (the mean of w0: the
    # cells kept over n, one fp32 division as the CPU's mean) are built per group as bytes and
    # repeated per sample on the host, so the device only takes views (no gather, no not, no mean).
    # An unmixed sample takes the last row: nothing from the partner.
    cell_rows = [*rows, bytes(n)]  # bytes 0/1 are bools; the byte work below runs in C
    keep_rows = [row.translate(_NOT) for row in cell_rows]
    label_rows = [_as_fp32(keep + cell) for keep, cell in zip(keep_rows, cell_rows)]
    lams = [to_fp32((n - sum(row)) / n) for row in cell_rows]
    picks = [g if a else len(cell_rows) - 1 for g, a in zip(pairs.group, pairs.applied)]
    b, (gh, gw) = len(picks), grid
    partner, applied, cells, keep, sources, weights, label_cells = columns_on(
        [
            column(pairs.partner, torch.int64), column(pairs.applied, torch.bool),
            column(b"".join(cell_rows[r] for r in picks), torch.bool, b, gh, gw),
            column(b"".join(keep_rows[r] for r in picks), torch.bool, b, gh, gw),
            sources_column(pairs),
            column([w for r in picks for w in (lams[r], to_fp32(1.0 - lams[r]))], torch.float32, b, 2),
            column(b"".join(label_rows[r] for r in picks), torch.float32, b, 2, gh, gw),
        ],
        device,
    )  # fmt: skip
    return CellParams(
        partner=partner, applied=applied, image_size=image_size, cells=cells, grid=grid, keep=keep,
        label_sources=sources, label_weights=weights, label_cells=label_cells,
    )  # fmt: skip


_FP32_ONE = array("f", [1.0]).tobytes()  # 1.0 as fp32 bytes, in the machine's order (as ``array`` writes a column)


def _as_fp32(bits: bytes) -> bytes:
    """0/1 bytes as fp32 0.0/1.0 bytes, ``array("f", list(bits)).tobytes()`` by three byte replacements (in C, where the
    list took a Python object a byte): ones to a marker first, so that the zeros' expansion leaves them alone."""
    return bits.replace(b"\x01", b"\x02").replace(b"\x00", bytes(4)).replace(b"\x02", _FP32_ONE)


class RandomCellSampler(_CellSampler):
    """MAE-style: exactly ``count`` cells chosen uniformly at random (a uniform subset)."""

    def cells_of(self, count: int, grid: tuple[int, int], rng: random.Random) -> list[bool]:
        row = [False] * (grid[0] * grid[1])
        for i in rng.sample(range(len(row)), count):
            row[i] = True
        return row


class BlockCellSampler(_CellSampler):
    """BEiT-style block-wise cells: random rectangles until the count is reached.

    BEiT's ``MaskingGenerator``: each attempt draws one rectangle (area uniform in
    ``[min_cells, remaining]``, log-uniform aspect ratio, strictly smaller than the grid);
    it is kept if it adds between 1 and ``remaining`` new cells. As in BEiT a group stops
    after 10 consecutive rejected attempts, so the count can fall a few cells short; the
    label uses the cells mixed. Python numbers: a few draws per block, no tensors.
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

    def cells_of(self, count: int, grid: tuple[int, int], rng: random.Random) -> list[bool]:
        gh, gw = grid
        cells = [False] * (gh * gw)
        cap = self.max_cells if self.max_cells is not None else gh * gw
        lo, hi = self.log_aspect
        done, fails = 0, 0
        # Each kept rectangle adds >= 1 cell and at most 10 attempts are rejected in a row: this ends.
        while done < count and fails < 10:
            room = min(count - done, cap)
            u0, u1, u2, u3 = rng.random(), rng.random(), rng.random(), rng.random()
            area = self.min_cells + u0 * (room - self.min_cells)  # random.uniform(a, b) allows a > b
            aspect = math.exp(lo + u1 * (hi - lo))
            h, w = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))  # half to even, as BEiT
            kept = False
            if h < gh and w < gw:
                top, left = math.floor(u2 * (gh - h + 1)), math.floor(u3 * (gw - w + 1))
                rect = [r * gw + c for r in range(top, top + h) for c in range(left, left + w)]
                new = sum(not cells[i] for i in rect)
                if 0 < new <= room:
                    for i in rect:
                        cells[i] = True
                    done, kept = done + new, True
            fails = 0 if kept else fails + 1
        return cells


class CellMixer(PairMixer[CellParams]):
    """A mixer of binary cells: on the CPU, where every mixed sample takes the same cells (``mode="batch"``), the
    partners are copied and the kept runs of cells copied back (``apply_cells``, the same pixels as the select);
    elsewhere, or for a per-pixel mask, the select."""

    def apply_images(self, images: Tensor, params: CellParams) -> Tensor:
        from mixlabels.strategies._paste import apply_cells  # it imports this module

        out = apply_cells(images, params)
        return super().apply_images(images, params) if out is None else out


class RandomPatchMix(CellMixer):
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


class BlockwiseMix(CellMixer):
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
