"""ResizeMix (Qin et al. 2020): the whole partner image, shrunk, pasted into a box of the sample.

Per draw: a scale ``tau ~ U(scale)`` (the paper: ``[0.1, 0.8]``); the box has sides
``floor(tau * gh)`` x ``floor(tau * gw)`` cells at a uniform position inside the
image; the partner is resized to the box's pixel size and pasted there. The
label weight of the partner is the box's true area (about ``tau ** 2``), as in
the paper: the partner's whole content is present, only smaller.

The resize is nearest-neighbour with pixel centres aligned (``F.interpolate``'s
``"nearest-exact"``; OpenMixup's ResizeMix defaults to nearest too): every pasted
pixel is a copy of a partner pixel, so the mix is a selection, exact in any dtype.
Boxes live on pixels or on ``patch_size`` cells, like CutMix's.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import ClassVar

import torch
from einops import rearrange
from torch import Tensor

from mixlabels._shape_cache import shape_cache
from mixlabels.strategies._base import MixParams, PairMixer
from mixlabels.strategies._cutmix import box_mask, grid_of, host_box_lam
from mixlabels.strategies._host_draws import HostPairs, column, columns_on, sources_column, to_fp32
from mixlabels.strategies._sampling import MixSampler, Mode, Pairing, Pairs, sample_uniform

__all__ = ["ResizeMix", "ResizeParams", "ResizeSampler", "resize_index", "resize_indices"]


@dataclass(frozen=True, eq=False, kw_only=True)
class ResizeParams(MixParams):
    """ResizeMix draws: the box each sample's partner is shrunk into.

    Attributes:
        boxes: ``(b, 4)`` long ``(y0, y1, x0, x1)`` in cells of ``grid``, half-open; empty where unmixed.
        grid: ``(gh, gw)`` cells; a cell covers ``(H / gh, W / gw)`` pixels.
        pixels: ``boxes`` in pixels, when the sampler computed them with its draws (Python draws, in the
            params' one buffer); ``None``: computed from ``boxes``.
        paste: where every mixed sample has the same box (``mode="batch"``, Python draws), that box in pixels
            ``(y0, y1, x0, x1)`` (empty where no sample is mixed), with what pasting it needs, computed with the
            draws: ``paste_rows`` ``(y1 - y0,)`` and ``paste_cols`` ``(x1 - x0,)`` long, the partner pixels the
            box's rows and columns read (``resize_index``'s), and ``paste_samples`` ``(m,)`` long, the mixed
            samples (an unmixed one, the middle of an odd flipped batch, keeps its pixels); ``None``: read from
            ``boxes``.
    """

    boxes: Tensor
    grid: tuple[int, int]
    pixels: Tensor | None = None
    paste: tuple[int, int, int, int] | None = None
    paste_rows: Tensor | None = None
    paste_cols: Tensor | None = None
    paste_samples: Tensor | None = None

    DERIVED: ClassVar[tuple[str, ...]] = (*MixParams.DERIVED, "pixels", "paste", "paste_rows", "paste_cols", "paste_samples")

    def source_weight(self) -> Tensor:
        return box_mask(self.boxes, self.grid)

    def cell_boxes(self) -> tuple[Tensor, tuple[int, int]]:
        return self.boxes, self.grid

    def pixel_boxes(self) -> Tensor:
        """``(b, 4)`` long boxes in pixels."""
        current = self.current()
        if current.pixels is not None:
            return current.pixels
        ch, cw = self.image_size[0] // self.grid[0], self.image_size[1] // self.grid[1]
        return self.boxes * torch.tensor([ch, ch, cw, cw], device=self.boxes.device)


def resize_index(start: Tensor, stop: Tensor, size: int) -> Tensor:
    """Source index of every output position when ``[0, size)`` is shrunk into ``[start, stop)``, ``(b, size)`` long.

    Nearest with aligned pixel centres: output ``p`` reads ``floor((p - start + 0.5) * size / (stop - start))``,
    clamped into the image (positions outside the box get some valid index; they are never selected).

    Example:
        >>> resize_index(torch.tensor([1]), torch.tensor([3]), 4).tolist()
        [[0, 1, 3, 3]]
    """
    pos = torch.arange(size, device=start.device, dtype=torch.float64)
    extent = (stop - start).clamp(min=1).double()
    src = torch.floor((pos[None, :] - start[:, None].double() + 0.5) * size / extent[:, None]).long()
    return src.clamp(0, size - 1)


def host_resize_index(start: int, stop: int, size: int) -> list[int]:
    """``resize_index`` of one box's own positions ``[start, stop)``, with Python numbers (the same float64
    arithmetic, in the same order): the source index of each."""
    extent = float(max(stop - start, 1))
    return [min(max(math.floor((p - start + 0.5) * size / extent), 0), size - 1) for p in range(start, stop)]


@shape_cache(maxsize=16)
def _axis_constants(size: tuple[int, int], device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per axis (rows, then columns) of an image of ``size``: its side ``(2, 1)`` float64, its first and last index
    ``(2, 1)`` long, and the positions ``(L,)`` float64 of the longer side (constants of the size: cached)."""
    sides = torch.tensor([[float(size[0])], [float(size[1])]], dtype=torch.float64, device=device)
    first = torch.zeros((2, 1), dtype=torch.long, device=device)
    return sides, first, sides.long() - 1, torch.arange(max(size), dtype=torch.float64, device=device)


def resize_indices(boxes: Tensor, size: tuple[int, int], inside: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """``resize_index`` of both axes at once, bit for bit (the same float64 arithmetic, each axis' side as a float64
    tensor), and with ``inside`` the pixels inside each box: rows ``(b, H)``, columns ``(b, W)`` long (views of one
    ``(b, 2, L)`` tensor), inside ``(b, H, W)`` bool. Boxes ``(b, 4)`` long ``(y0, y1, x0, x1)`` in pixels. A dozen
    operators where each axis' own and the box mask took about thirty (on a GPU, each one a launch)."""
    hh, ww = size
    sides, first, last, pos = _axis_constants((int(hh), int(ww)), boxes.device)
    start, stop = boxes.reshape(-1, 2, 2).unbind(2)  # b 2: each axis' start and stop
    extent = (stop - start).clamp(min=1).double().unsqueeze(-1)  # b 2 1
    src = torch.floor((pos - start.double().unsqueeze(-1) + 0.5) * sides / extent).long()  # b 2 L
    src = src.clamp(first, last)
    within = None
    if inside:
        along = (pos >= start.unsqueeze(-1)) & (pos < stop.unsqueeze(-1))  # b 2 L: inside the box along each axis
        within = along[:, 0, :hh, None] & along[:, 1, None, :ww]
    return src[:, 0, :hh], src[:, 1, :ww], within


class ResizeSampler(MixSampler[ResizeParams]):
    """Draws ResizeMix boxes: side ratio ``tau ~ U(scale)`` per group, position uniform inside the grid.

    Args:
        scale: ``(min, max)`` side ratio of the box, ``0 <= min <= max <= 1`` (the paper: ``(0.1, 0.8)``).
        cell: cell size in pixels the box snaps to; ``None`` for pixels.
        mode, pairing, prob: see ``MixSampler``.
    """

    params_type = ResizeParams
    host_draws = True

    def __init__(
        self,
        scale: tuple[float, float] = (0.1, 0.8),
        cell: int | None = None,
        mode: Mode = "batch",
        pairing: Pairing = "flip",
        prob: float = 1.0,
    ) -> None:
        lo, hi = scale
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"scale must satisfy 0 <= min <= max <= 1 (the box side as a fraction of the image), got {scale}")
        if cell is not None and cell < 1:
            raise ValueError(f"patch_size must be a positive number of pixels, got {cell}")
        super().__init__(mode, pairing, prob)
        self.scale = (float(lo), float(hi))
        self.cell = cell

    def __repr__(self) -> str:
        return f"scale={self.scale}, cell={self.cell}, {super().__repr__()}"

    def check_image_size(self, image_size: tuple[int, int]) -> None:
        super().check_image_size(image_size)
        gh, gw = grid_of(image_size, self.cell, "patch_size")
        lo, hi = self.scale
        side = min(gh, gw)
        # A box side is floor(tau * side) with tau in [lo, hi) (tau == lo when lo == hi): some box is
        # non-empty only if tau * side can reach 1. Otherwise nothing would ever be mixed.
        if not (hi * side > 1.0 or (lo == hi and hi * side >= 1.0)):
            unit = "cells" if self.cell is not None else "px"
            raise ValueError(
                f"scale={self.scale} gives only empty boxes on {image_size[0]}x{image_size[1]} images "
                f"(a {gh}x{gw} grid of {unit}): a box side is floor(tau * {side}) with tau <= {hi}, always 0, so "
                f"nothing would be mixed; raise scale's max above 1/{side} = {1 / side:.4g}, or use larger images"
                + (" or a smaller patch_size" if self.cell is not None else "")
            )

    def draw(self, pairs: Pairs, image_size: tuple[int, int], generator: torch.Generator | None, device: torch.device) -> ResizeParams:
        gh, gw = grid_of(image_size, self.cell, "patch_size")
        u = sample_uniform((pairs.num_groups, 3), generator, device)
        tau = self.scale[0] + u[:, 0] * (self.scale[1] - self.scale[0])
        bh = torch.floor(tau * gh).long()
        bw = torch.floor(tau * gw).long()
        y0 = torch.floor(u[:, 1] * (gh - bh + 1)).long().clamp(max=gh - bh)
        x0 = torch.floor(u[:, 2] * (gw - bw + 1)).long().clamp(max=gw - bw)
        boxes = torch.stack([y0, y0 + bh, x0, x0 + bw], dim=1)[pairs.group]
        # A draw whose box rounds to nothing mixes nothing: say so in the params (applied False, box zeroed).
        applied = pairs.applied & ((bh > 0) & (bw > 0))[pairs.group]
        boxes = torch.where(applied[:, None], boxes, torch.zeros_like(boxes))  # empty box: unmixed
        return ResizeParams(partner=pairs.partner, applied=applied, image_size=image_size, boxes=boxes, grid=(gh, gw))

    def draw_host(self, pairs: HostPairs, image_size: tuple[int, int], rng: random.Random, device: torch.device) -> ResizeParams:
        """``draw``'s law with Python numbers: per group a side ratio and a corner, in one buffer with the boxes in
        pixels and the label map's sources and weights (``host_box_lam``)."""
        gh, gw = grid_of(image_size, self.cell, "patch_size")
        lo, hi = self.scale
        boxes: list[tuple[int, int, int, int] | None] = []
        for _ in range(pairs.num_groups):
            u = [rng.random() for _ in range(3)]
            tau = lo + u[0] * (hi - lo)
            bh, bw = math.floor(tau * gh), math.floor(tau * gw)
            y0 = min(math.floor(u[1] * (gh - bh + 1)), gh - bh)
            x0 = min(math.floor(u[2] * (gw - bw + 1)), gw - bw)
            # a draw whose box rounds to nothing mixes nothing: say so in the params (applied False, box zeroed)
            boxes.append((y0, y0 + bh, x0, x0 + bw) if bh > 0 and bw > 0 else None)
        rows = [boxes[g] if a else None for g, a in zip(pairs.group, pairs.applied)]
        picked = [(0, 0, 0, 0) if r is None else r for r in rows]
        n = gh * gw
        lams = [host_box_lam(box, n) for box in picked]
        b = len(picked)
        ch, cw = image_size[0] // gh, image_size[1] // gw
        # mode "batch": one box for every mixed sample, so the paste is planned here: its source rows and columns and
        # the samples it writes (the device then gathers the box's pixels and writes them, no index arithmetic)
        mixed = [i for i, r in enumerate(rows) if r is not None]
        paste = None
        if self.mode == "batch":
            y0, y1, x0, x1 = picked[mixed[0]] if mixed else (0, 0, 0, 0)
            paste = (y0 * ch, y1 * ch, x0 * cw, x1 * cw)
        plan = [] if paste is None else [
            column(host_resize_index(paste[0], paste[1], image_size[0]), torch.int64),
            column(host_resize_index(paste[2], paste[3], image_size[1]), torch.int64),
            column(mixed, torch.int64),
        ]  # fmt: skip
        partner, applied, boxes_t, pixels, sources, weights, *planned = columns_on(
            [
                column(pairs.partner, torch.int64), column([r is not None for r in rows], torch.bool),
                column([v for box in picked for v in box], torch.int64, b, 4),
                column([v * c for box in picked for v, c in zip(box, (ch, ch, cw, cw))], torch.int64, b, 4),
                sources_column(pairs),
                column([w for lam in lams for w in (lam, to_fp32(1.0 - lam))], torch.float32, b, 2),
                *plan,
            ],
            device,
        )  # fmt: skip
        paste_rows, paste_cols, paste_samples = planned if planned else (None, None, None)
        return ResizeParams(
            partner=partner, applied=applied, image_size=image_size, boxes=boxes_t, grid=(gh, gw), pixels=pixels,
            paste=paste, paste_rows=paste_rows, paste_cols=paste_cols, paste_samples=paste_samples,
            label_sources=sources, label_weights=weights,
        )  # fmt: skip


class ResizeMix(PairMixer[ResizeParams]):
    """ResizeMix as a kornia augmentation producing a ``TokenLabelMap`` (the map keeps the boxes).

    Args:
        num_classes: ``c``.
        scale: ``(min, max)`` side ratio of the pasted partner (the paper: ``(0.1, 0.8)``).
        patch_size: snap boxes to this cell size (the token grid); ``None`` for pixel boxes.
        label_smoothing: in ``[0, 1)``.
        prob: probability of mixing, per batch, pair or sample according to ``mode``.
        mode: ``"batch"``, ``"pair"`` or ``"elem"``; samples sharing a draw share the box.
        pairing: ``"flip"``, ``"derangement"`` or ``"roll"``.
        generator: default source of randomness.

    Example:
        >>> rm = ResizeMix(num_classes=10, scale=(0.5, 0.5), generator=torch.Generator().manual_seed(0))
        >>> mixed, lm = rm(torch.rand(2, 3, 16, 16), torch.tensor([3, 7]))
        >>> lm.image_weights[:, 1].tolist()  # an 8x8 box: a quarter of the image shows the partner
        [0.25, 0.25]
    """

    def __init__(
        self,
        num_classes: int,
        scale: tuple[float, float] = (0.1, 0.8),
        patch_size: int | None = None,
        label_smoothing: float = 0.0,
        prob: float = 1.0,
        mode: Mode = "batch",
        pairing: Pairing = "flip",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(ResizeSampler(scale, patch_size, mode, pairing, prob), num_classes, label_smoothing, generator)

    def apply_images(self, images: Tensor, params: ResizeParams) -> Tensor:
        """Paste each partner, shrunk, into the sample's box; samples with an empty box are copied unchanged."""
        hh, ww = images.shape[2], images.shape[3]
        current = params.current()
        if current.paste is not None and not torch.compiler.is_compiling():
            return _paste_planned(images, current)
        boxes = params.pixel_boxes().to(images.device)
        partner = params.partner.to(images.device)
        on_host = images.device.type == "cpu" and not torch.compiler.is_compiling()
        rows, cols, inside = resize_indices(boxes, (hh, ww), inside=not on_host)  # b H, b W, b H W
        if on_host:
            # Only the boxes are read and written, instead of gathering every pixel of every partner
            # (the traced path below, whose shapes do not depend on the draw): one batched paste when
            # every mixed sample has the same box (mode "batch"), else one small gather per sample.
            applied = params.applied.to(images.device)
            mixed = applied.nonzero()[:, 0]
            if mixed.numel() and bool((boxes[mixed] == boxes[mixed[0]]).all()):
                first = int(mixed[0])
                y0, y1, x0, x1 = boxes[first].tolist()
                return _paste_shrunk(images, partner, mixed, (y0, y1, x0, x1), rows[first, y0:y1], cols[first, x0:x1])
            out = images.clone()
            for i, ((y0, y1, x0, x1), j) in enumerate(zip(boxes.tolist(), partner.tolist())):
                if y1 > y0 and x1 > x0:
                    src = images[j].index_select(1, rows[i, y0:y1]).index_select(2, cols[i, x0:x1])
                    out[i, :, y0:y1, x0:x1] = src
            return out
        assert inside is not None
        shrunk = images[rearrange(partner, "b -> b 1 1"), :, rearrange(rows, "b h -> b h 1"), rearrange(cols, "b w -> b 1 w")]
        return torch.where(rearrange(inside, "b h w -> b 1 h w"), rearrange(shrunk, "b h w c -> b c h w"), images)


def _paste_planned(images: Tensor, params: ResizeParams) -> Tensor:
    """The batch's one box, planned with the draws (``ResizeParams.paste``): ``_paste_shrunk`` with no index
    arithmetic on the device (on a GPU: three launches, where computing every sample's indices and selecting every
    pixel took about twenty)."""
    assert params.paste is not None and params.paste_rows is not None and params.paste_cols is not None
    assert params.paste_samples is not None
    dev = images.device
    return _paste_shrunk(
        images, params.partner.to(dev), params.paste_samples.to(dev), params.paste, params.paste_rows.to(dev),
        params.paste_cols.to(dev),
    )


def _paste_shrunk(
    images: Tensor, partner: Tensor, samples: Tensor, box: tuple[int, int, int, int], rows: Tensor, cols: Tensor,
) -> Tensor:
    """A copy of ``images`` where the one pixel box ``(y0, y1, x0, x1)`` of each of ``samples`` (``(m,)`` long: the
    mixed ones) shows its partner shrunk: the partner's pixels at ``rows`` ``(y1 - y0,)`` and ``cols`` ``(x1 - x0,)``.
    One gather of just the pasted pixels, straight from the partners, and one write (a slice where every sample is
    mixed, no scattered write)."""
    y0, y1, x0, x1 = box
    out = images.clone()
    m = int(samples.shape[0])
    if m and y1 > y0 and x1 > x0:
        every = m == images.shape[0]
        source = partner if every else partner[samples]
        # m bh bw c: the advanced indices around the channel slice come first
        shrunk = images[rearrange(source, "m -> m 1 1"), :, rearrange(rows, "h -> 1 h 1"), rearrange(cols, "w -> 1 1 w")]
        shrunk = rearrange(shrunk, "m h w c -> m c h w")
        if every:
            out[:, :, y0:y1, x0:x1] = shrunk
        else:
            out[samples, :, y0:y1, x0:x1] = shrunk
    return out
