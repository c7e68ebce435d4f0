"""CutMix: a box pasted from the partner, sampled exactly as timm samples it.

The box lives on a grid of cells: pixels (free CutMix, the mask is per pixel) or
``patch_size`` cells (the box snapped to the token grid, as the official TL-Align
code does, so no token is cut). Boxes are half-open ``[y0, y1) x [x0, x1)`` in cells.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from mixlabels._mask import box_cells
from mixlabels.strategies._base import MixParams, PairMixer
from mixlabels.strategies._host_draws import HostPairs, column, columns_on, draw_beta, sources_column, to_fp32
from mixlabels.strategies._mixup import check_alpha
from mixlabels.strategies._sampling import MixSampler, Mode, Pairing, Pairs, sample_beta, sample_uniform

__all__ = ["CutMix", "BoxParams", "BoxSampler", "cutmix_boxes", "minmax_boxes", "box_mask", "grid_of"]


@dataclass(frozen=True, eq=False, kw_only=True)
class BoxParams(MixParams):
    """CutMix draws: a box per sample on a cell grid, filled from the partner.

    Attributes:
        boxes: ``(b, 4)`` long ``(y0, y1, x0, x1)`` in cells, half-open; empty where unmixed.
        lam: ``(b,)`` fp32 lambda drawn from Beta (before timm's correction); 1 where unmixed.
        grid: ``(gh, gw)`` cells; a cell covers ``(H / gh, W / gw)`` pixels.
        correct_lam: the label weight is the box's true area (timm's ``correct_lam``);
            otherwise it is the drawn ``lam`` (timm's legacy, which the pixels do not follow).
        shared: every mixed sample has the same box (``mode="batch"``).
        pixel_box: that shared box in pixels ``(y0, y1, x0, x1)``, when it was drawn on the host
            (Python draws): read without touching ``boxes``, wherever they live.
        keep_axes: ``(b, 2, L)`` bool, ``L = max(gh, gw)``: per sample, the rows (then the columns) outside its
            box, when they were drawn on the host (a box per sample: ``mode`` ``"pair"`` or ``"elem"``); a cell
            keeps the sample's pixels where its row or its column is outside. ``None``: from ``boxes``.
    """

    boxes: Tensor
    lam: Tensor
    grid: tuple[int, int]
    correct_lam: bool = True
    shared: bool = False  # one box for the whole batch (mode "batch"); unmixed samples hold empty boxes
    pixel_box: tuple[int, int, int, int] | None = None
    keep_axes: Tensor | None = None

    DERIVED: ClassVar[tuple[str, ...]] = (*MixParams.DERIVED, "pixel_box", "keep_axes")

    def source_weight(self) -> Tensor:
        return box_mask(self.boxes, self.grid)

    def cell_boxes(self) -> tuple[Tensor, tuple[int, int]]:
        return self.boxes, self.grid

    def keep_cells(self) -> Tensor:
        current = self.current()
        if current.keep_axes is None:
            return ~box_inside(self.boxes, self.grid)
        gh, gw = self.grid
        return current.keep_axes[:, 0, :gh, None] | current.keep_axes[:, 1, None, :gw]  # one launch on a GPU

    def shared_box(self) -> tuple[int, int, int, int] | None:
        # Only when the params live on the CPU (the default generator's device): reading the
        # box is then free, whereas on an accelerator it would stall the stream. Never while
        # compiling: the box would be a data-dependent Python int (a graph break, an error
        # under fullgraph); the traced select path computes the same pixels.
        if self.pixel_box is not None and self.shared and not self.token_space and not torch.compiler.is_compiling():
            return self.pixel_box
        if (
            not self.shared
            or self.token_space
            or self.boxes.device.type != "cpu"
            or self.boxes.shape[0] == 0  # an empty batch has no box to read (the select path returns it empty)
            or torch.compiler.is_compiling()
        ):
            return None
        ch, cw = self.image_size[0] // self.grid[0], self.image_size[1] // self.grid[1]
        y0, y1, x0, x1 = (int(v) for v in self.boxes.amax(dim=0).tolist())  # the empty boxes are all zeros
        return y0 * ch, y1 * ch, x0 * cw, x1 * cw

    @property
    def lambda_is_mask_mean(self) -> bool:
        return self.correct_lam

    def image_weight(self) -> Tensor:
        if self.correct_lam:
            return self.source_weight().mean(dim=(1, 2))
        return self.lam.float()


box_inside = box_cells  # the cells inside each box, (b, gh, gw) bool


def box_mask(boxes: Tensor, grid: tuple[int, int]) -> Tensor:
    """Weight of the sample itself on the grid: 0 inside each box, 1 outside, ``(b, gh, gw)`` fp32."""
    return (~box_inside(boxes, grid)).float()


def cutmix_boxes(lam: Tensor, cy: Tensor, cx: Tensor, grid: tuple[int, int]) -> Tensor:
    """timm's ``rand_bbox`` for given lambdas and centres, batched: ``(n, 4)`` long.

    The side is ``int(g * sqrt(1 - lam))``, the centre any cell, and the box is
    clipped to the grid, so boxes reach every edge and clipping shrinks them (hence
    timm's lambda correction).

    Args:
        lam: ``(n,)`` lambdas in ``[0, 1]``.
        cy: ``(n,)`` long centre rows in ``[0, gh)``.
        cx: ``(n,)`` long centre columns in ``[0, gw)``.
        grid: ``(gh, gw)``.

    Returns:
        ``(n, 4)`` boxes ``(y0, y1, x0, x1)``.

    Example:
        >>> cutmix_boxes(torch.tensor([0.75]), torch.tensor([0]), torch.tensor([7]), (8, 8)).tolist()
        [[0, 2, 5, 8]]
    """
    gh, gw = grid
    ratio = torch.sqrt(1.0 - lam.double())  # float64 like numpy, so int() truncates the same values
    cut_h = torch.floor(gh * ratio).long()
    cut_w = torch.floor(gw * ratio).long()
    y0 = (cy - cut_h // 2).clamp(0, gh)
    y1 = (cy + (cut_h + 1) // 2).clamp(0, gh)
    x0 = (cx - cut_w // 2).clamp(0, gw)
    x1 = (cx + (cut_w + 1) // 2).clamp(0, gw)
    return torch.stack([y0, y1, x0, x1], dim=1)


def minmax_boxes(
    minmax: tuple[float, float], grid: tuple[int, int], n: int, generator: torch.Generator | None, device: torch.device
) -> Tensor:
    """timm's ``rand_bbox_minmax``, batched: side ratios uniform in ``minmax``, box inside the grid.

    Returns:
        ``(n, 4)`` long boxes ``(y0, y1, x0, x1)``.
    """
    gh, gw = grid
    lo_h, hi_h = int(gh * minmax[0]), int(gh * minmax[1])
    lo_w, hi_w = int(gw * minmax[0]), int(gw * minmax[1])
    if lo_h >= hi_h or lo_w >= hi_w:
        raise ValueError(
            f"minmax={minmax} gives no box size on a {gh}x{gw} grid (sides in [{lo_h}, {hi_h}) x [{lo_w}, {hi_w})); "
            "widen minmax or use larger images"
        )
    u = sample_uniform((n, 4), generator, device)
    cut_h = lo_h + torch.floor(u[:, 0] * (hi_h - lo_h)).long().clamp(max=hi_h - lo_h - 1)
    cut_w = lo_w + torch.floor(u[:, 1] * (hi_w - lo_w)).long().clamp(max=hi_w - lo_w - 1)
    y0 = torch.minimum(torch.floor(u[:, 2] * (gh - cut_h + 1)).long(), gh - cut_h)
    x0 = torch.minimum(torch.floor(u[:, 3] * (gw - cut_w + 1)).long(), gw - cut_w)
    return torch.stack([y0, y0 + cut_h, x0, x0 + cut_w], dim=1)


def host_box(lam: float, cy: int, cx: int, grid: tuple[int, int]) -> tuple[int, int, int, int]:
    """``cutmix_boxes`` for one box, with Python numbers (the same float64 arithmetic)."""
    gh, gw = grid
    ratio = math.sqrt(1.0 - lam)
    cut_h, cut_w = math.floor(gh * ratio), math.floor(gw * ratio)
    return (
        min(max(cy - cut_h // 2, 0), gh), min(max(cy + (cut_h + 1) // 2, 0), gh),
        min(max(cx - cut_w // 2, 0), gw), min(max(cx + (cut_w + 1) // 2, 0), gw),
    )  # fmt: skip


def _outside(box: tuple[int, int, int, int], length: int) -> bytes:
    """Bool bytes of a box's rows outside it, then its columns, each axis over ``length`` cells (1: outside).

    Example:
        >>> _outside((1, 3, 0, 2), 4).hex()
        '0100000100000101'
    """
    y0, y1, x0, x1 = box
    return b"".join(b"\x01" * lo + bytes(hi - lo) + b"\x01" * (length - hi) for lo, hi in ((y0, y1), (x0, x1)))


def host_minmax_box(minmax: tuple[float, float], grid: tuple[int, int], rng: random.Random) -> tuple[int, int, int, int]:
    """``minmax_boxes`` for one box, with Python numbers (the same law and arithmetic)."""
    gh, gw = grid
    lo_h, hi_h = int(gh * minmax[0]), int(gh * minmax[1])
    lo_w, hi_w = int(gw * minmax[0]), int(gw * minmax[1])
    if lo_h >= hi_h or lo_w >= hi_w:
        minmax_boxes(minmax, grid, 0, None, torch.device("cpu"))  # raises the error that names the sizes
    u = [rng.random() for _ in range(4)]
    cut_h = lo_h + min(math.floor(u[0] * (hi_h - lo_h)), hi_h - lo_h - 1)
    cut_w = lo_w + min(math.floor(u[1] * (hi_w - lo_w)), hi_w - lo_w - 1)
    y0 = min(math.floor(u[2] * (gh - cut_h + 1)), gh - cut_h)
    x0 = min(math.floor(u[3] * (gw - cut_w + 1)), gw - cut_w)
    return y0, y0 + cut_h, x0, x0 + cut_w


def host_box_lam(box: tuple[int, int, int, int], cells: int) -> float:
    """The label's lambda of a box ``(y0, y1, x0, x1)`` on a grid of ``cells`` cells, as ``BoxMask.source_mean``
    computes it on the CPU: the cells left to the sample over the cell count, one fp32 division (the quotient
    rounded to float64, then to fp32, rounds as fp32 division does)."""
    y0, y1, x0, x1 = box
    return to_fp32((cells - (y1 - y0) * (x1 - x0)) / cells)


def grid_of(image_size: tuple[int, int], cell: int | None, what: str) -> tuple[int, int]:
    """The cell grid of an image, or a clear error if ``cell`` does not divide it."""
    hh, ww = image_size
    if cell is None:
        return hh, ww
    if hh % cell or ww % cell:
        raise ValueError(
            f"{what}={cell} does not divide the image size {hh}x{ww}; resize or crop the images to a "
            f"multiple of {cell}, or pick a {what} that divides both sides"
        )
    return hh // cell, ww // cell


class BoxSampler(MixSampler[BoxParams]):
    """Draws timm CutMix boxes (Beta lambda, or ``minmax`` ratios) on a pixel or cell grid.

    Args:
        alpha: Beta(alpha, alpha) concentration, > 0.
        minmax: ``(min, max)`` side ratios; when set, boxes ignore lambda and the label uses the box area.
        correct_lam: use the clipped box area as lambda (timm's default).
        cell: cell size in pixels the box snaps to; ``None`` for pixels.
        token_space: params are for mixing patch embeddings (MixToken).
        mode, pairing, prob: see ``MixSampler``.
    """

    params_type = BoxParams
    host_draws = True

    def __init__(
        self,
        alpha: float = 1.0,
        minmax: tuple[float, float] | None = None,
        correct_lam: bool = True,
        cell: int | None = None,
        token_space: bool = False,
        mode: Mode = "batch",
        pairing: Pairing = "flip",
        prob: float = 1.0,
    ) -> None:
        check_alpha(alpha)
        if minmax is not None:
            if len(minmax) != 2:
                raise ValueError(f"minmax must be a pair (min, max) of box side ratios, got {minmax}")
            lo, hi = minmax
            if not (0.0 <= lo < hi <= 1.0):
                raise ValueError(f"minmax must satisfy 0 <= min < max <= 1 (box side ratios), got {minmax}")
        if cell is not None and cell < 1:
            raise ValueError(f"patch_size must be a positive number of pixels, got {cell}")
        super().__init__(mode, pairing, prob)
        self.alpha = float(alpha)
        self.minmax = None if minmax is None else (float(minmax[0]), float(minmax[1]))
        self.correct_lam = bool(correct_lam) or minmax is not None  # timm always corrects with minmax
        self.cell = cell
        self.token_space = token_space

    def __repr__(self) -> str:
        return f"alpha={self.alpha}, minmax={self.minmax}, correct_lam={self.correct_lam}, cell={self.cell}, {super().__repr__()}"

    def check_image_size(self, image_size: tuple[int, int]) -> None:
        super().check_image_size(image_size)
        grid_of(image_size, self.cell, "patch_size")

    def draw(self, pairs: Pairs, image_size: tuple[int, int], generator: torch.Generator | None, device: torch.device) -> BoxParams:
        grid = grid_of(image_size, self.cell, "patch_size")
        g = pairs.num_groups
        lam = sample_beta(self.alpha, g, generator, device)
        if self.minmax is not None:
            boxes = minmax_boxes(self.minmax, grid, g, generator, device)
        else:
            cy = torch.randint(0, grid[0], (g,), generator=generator, device=device)
            cx = torch.randint(0, grid[1], (g,), generator=generator, device=device)
            boxes = cutmix_boxes(lam, cy, cx, grid)
        boxes, lam = boxes[pairs.group], lam[pairs.group]
        boxes = torch.where(pairs.applied[:, None], boxes, torch.zeros_like(boxes))  # empty box: unmixed
        lam = torch.where(pairs.applied, lam, torch.ones_like(lam))
        return BoxParams(
            partner=pairs.partner,
            applied=pairs.applied,
            image_size=image_size,
            token_space=self.token_space,
            boxes=boxes,
            lam=lam,
            grid=grid,
            correct_lam=self.correct_lam,
            shared=self.mode == "batch",
        )


    def draw_host(self, pairs: HostPairs, image_size: tuple[int, int], rng: random.Random, device: torch.device) -> BoxParams:
        grid = grid_of(image_size, self.cell, "patch_size")
        lams, boxes = [], []
        for _ in range(pairs.num_groups):  # per group: lambda, then the box (centre, or minmax sides and corner)
            lam = draw_beta(self.alpha, rng)
            if self.minmax is not None:
                boxes.append(host_minmax_box(self.minmax, grid, rng))
            else:
                boxes.append(host_box(lam, rng.randrange(grid[0]), rng.randrange(grid[1]), grid))
            lams.append(to_fp32(lam))
        # Per group, then an unmixed row (empty box, lambda 1); samples pick rows. The label's lambda is
        # ``BoxMask.source_mean``'s on the CPU (``host_box_lam``).
        n = grid[0] * grid[1]
        boxes.append((0, 0, 0, 0))
        lams.append(1.0)
        label_lams = [host_box_lam(box, n) for box in boxes] if self.correct_lam else lams
        weight_rows = [(v, to_fp32(1.0 - v)) for v in label_lams]
        picks = [g if a else len(boxes) - 1 for g, a in zip(pairs.group, pairs.applied)]
        b = len(picks)
        # a box per sample: the rows and columns outside each, as bytes (the device then takes one "or" for the keep
        # mask, where comparing the boxes with every cell took five launches)
        axes = [] if self.mode == "batch" else [column(b"".join(_outside(boxes[r], max(grid)) for r in picks), torch.bool, b, 2, max(grid))]
        partner, applied, lam_t, boxes_t, sources, weights, *keep_axes = columns_on(
            [
                column(pairs.partner, torch.int64), column(pairs.applied, torch.bool),
                column([lams[r] for r in picks], torch.float32),
                column([v for r in picks for v in boxes[r]], torch.int64, b, 4),
                sources_column(pairs),
                column([w for r in picks for w in weight_rows[r]], torch.float32, b, 2),
                *axes,
            ],
            device,
        )  # fmt: skip
        ch, cw = image_size[0] // grid[0], image_size[1] // grid[1]
        shared = boxes[0] if self.mode == "batch" and any(pairs.applied) else boxes[-1]
        return BoxParams(
            partner=partner, applied=applied, image_size=image_size, token_space=self.token_space,
            boxes=boxes_t, lam=lam_t, grid=grid, correct_lam=self.correct_lam,
            shared=self.mode == "batch",
            pixel_box=(shared[0] * ch, shared[1] * ch, shared[2] * cw, shared[3] * cw) if self.mode == "batch" else None,
            keep_axes=keep_axes[0] if keep_axes else None,
            label_sources=sources, label_weights=weights,
        )  # fmt: skip


class CutMix(PairMixer[BoxParams]):
    """CutMix as a kornia augmentation producing a ``TokenLabelMap``, timm-compatible.

    The map's mask is per pixel (free boxes) or per ``patch_size`` cell (snapped boxes):
    the coarsest resolution at which it is exact.

    Args:
        num_classes: ``c``.
        alpha: Beta(alpha, alpha) concentration (timm's ``cutmix_alpha``).
        minmax: timm's ``cutmix_minmax`` side ratios; overrides ``alpha`` for the box.
        correct_lam: lambda is the box's true (clipped) area, as timm's default; with
            ``False`` the label keeps the drawn lambda (timm's legacy), and the image
            weight then differs from the mask mean.
        patch_size: snap boxes to this cell size (the token grid); ``None`` for pixel boxes.
        label_smoothing: in ``[0, 1)``.
        prob: probability of mixing, per batch, pair or sample according to ``mode``.
        mode: ``"batch"``, ``"pair"`` or ``"elem"``, as timm.
        pairing: ``"flip"``, ``"derangement"`` or ``"roll"``.
        generator: default source of randomness.

    Example:
        >>> cutmix = CutMix(num_classes=10, patch_size=4, generator=torch.Generator().manual_seed(0))
        >>> mixed, lm = cutmix(torch.rand(2, 3, 16, 16), torch.tensor([3, 7]))
        >>> lm.mask.dense().shape, bool((lm.image_weights[:, 0] == lm.mask.dense()[:, 0].mean((1, 2))).all())
        (torch.Size([2, 2, 4, 4]), True)
    """

    def __init__(
        self,
        num_classes: int,
        alpha: float = 1.0,
        minmax: tuple[float, float] | None = None,
        correct_lam: bool = True,
        patch_size: int | None = None,
        label_smoothing: float = 0.0,
        prob: float = 1.0,
        mode: Mode = "batch",
        pairing: Pairing = "flip",
        generator: torch.Generator | None = None,
    ) -> None:
        sampler = BoxSampler(alpha, minmax, correct_lam, patch_size, False, mode, pairing, prob)
        super().__init__(sampler, num_classes, label_smoothing, generator)

    def apply_images(self, images: Tensor, params: BoxParams) -> Tensor:
        """A box per sample (``mode`` pair or elem) on the CPU, eager: the batch copied, then each box from its partner
        (``apply_boxes``: the select's pixels, a copy a box, as timm's elem CutMix); otherwise ``PairMixer``'s (the
        batch's one box pasted, or the select)."""
        if not params.shared and not params.token_space:
            from mixlabels.strategies._paste import apply_boxes  # it imports this module (through _patch)

            out = apply_boxes(images, params)
            if out is not None:
                return out
        return super().apply_images(images, params)
