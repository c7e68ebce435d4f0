"""Random crops and flips sampled apart from their application, applied to images and score maps alike (RoIAlign)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mixlabels.score_maps._topk import Fill, TopKMaps

__all__ = ["CropParams", "sample_resized_crops", "sample_padded_crops", "crop_resize", "align_score_maps"]

Padding = Literal["border", "zeros"]


@dataclass(frozen=True, eq=False)
class CropParams:
    """Random crops of a batch, sampled apart from their application (and replayable).

    Args:
        boxes: ``(b, 4)`` fp32 ``x0, y0, x1, y1`` in pixels of each original image (edges,
            not centres: the whole image is ``0, 0, W, H``); a box may reach past the
            image (crops of a zero-padded image).
        flips: ``(b,)`` bool, a horizontal flip applied after the crop.
        image_sizes: ``(b, 2)`` long ``(H, W)`` of each original image.
    """

    boxes: Tensor
    flips: Tensor
    image_sizes: Tensor


def _sizes(image_sizes: Tensor | tuple[int, int], b: int) -> Tensor:
    if isinstance(image_sizes, Tensor):
        return image_sizes.long().reshape(b, 2)
    return torch.tensor(image_sizes, dtype=torch.long).expand(b, 2).clone()


def check_crop_distribution(scale: tuple[float, float], ratio: tuple[float, float], hflip: float) -> None:
    """Raise a clear error unless ``scale``, ``ratio`` and ``hflip`` describe a crop distribution."""
    if len(scale) != 2 or not 0.0 < scale[0] <= scale[1] <= 1.0:
        raise ValueError(f"scale must be (min, max) area fractions with 0 < min <= max <= 1, got {scale}")
    if len(ratio) != 2 or not 0.0 < ratio[0] <= ratio[1] < float("inf"):
        raise ValueError(f"ratio must be (min, max) aspect ratios with 0 < min <= max, got {ratio}")
    if not 0.0 <= hflip <= 1.0:
        raise ValueError(f"hflip must be a probability in [0, 1], got {hflip}")


def sample_resized_crops(
    image_sizes: Tensor | tuple[int, int],
    batch_size: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    hflip: float = 0.5,
    generator: torch.Generator | None = None,
) -> CropParams:
    """torchvision's ``RandomResizedCrop`` boxes (10 tries, then a centre crop) and flips, per sample.

    Example:
        >>> p = sample_resized_crops((32, 32), 4, generator=torch.Generator().manual_seed(0))
        >>> tuple(p.boxes.shape), bool((p.boxes[:, 2:] <= 32).all())
        ((4, 4), True)
    """
    check_crop_distribution(scale, ratio, hflip)
    b, tries = batch_size, 10
    sizes = _sizes(image_sizes, b)
    hh, ww = sizes[:, 0:1].double(), sizes[:, 1:2].double()
    area = hh * ww
    u = torch.rand(b, tries, 4, generator=generator, dtype=torch.float64)
    target = area * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * u[..., 1])
    w = torch.round(torch.sqrt(target * aspect))
    h = torch.round(torch.sqrt(target / aspect))
    ok = (w > 0) & (w <= ww) & (h > 0) & (h <= hh)
    first = torch.where(ok.any(1), ok.double().argmax(1), torch.full((b,), -1, dtype=torch.long))
    pick = first.clamp_min(0).unsqueeze(1)
    w_, h_ = w.gather(1, pick).squeeze(1), h.gather(1, pick).squeeze(1)
    y0 = torch.floor(u[..., 2].gather(1, pick).squeeze(1) * (hh[:, 0] - h_ + 1))
    x0 = torch.floor(u[..., 3].gather(1, pick).squeeze(1) * (ww[:, 0] - w_ + 1))
    # fallback of torchvision: a centre crop with the aspect ratio clamped to the range
    in_ratio = ww[:, 0] / hh[:, 0]
    fw = torch.where(in_ratio < ratio[0], ww[:, 0], torch.where(in_ratio > ratio[1], torch.round(hh[:, 0] * ratio[1]), ww[:, 0]))
    fh = torch.where(in_ratio < ratio[0], torch.round(ww[:, 0] / ratio[0]), hh[:, 0])
    fallback = first < 0
    w_, h_ = torch.where(fallback, fw, w_), torch.where(fallback, fh, h_)
    y0 = torch.where(fallback, torch.floor((hh[:, 0] - h_) / 2), y0)
    x0 = torch.where(fallback, torch.floor((ww[:, 0] - w_) / 2), x0)
    boxes = torch.stack([x0, y0, x0 + w_, y0 + h_], dim=1).float()
    flips = torch.rand(b, generator=generator) < hflip
    return CropParams(boxes, flips, sizes)


def sample_padded_crops(
    image_size: tuple[int, int],
    batch_size: int,
    padding: int = 4,
    hflip: float = 0.5,
    generator: torch.Generator | None = None,
) -> CropParams:
    """CIFAR's augmentation: an image-sized crop of the image zero-padded by ``padding``, and flips."""
    hh, ww = image_size
    off = torch.randint(0, 2 * padding + 1, (batch_size, 2), generator=generator).float() - padding  # dy, dx
    boxes = torch.stack([off[:, 1], off[:, 0], off[:, 1] + ww, off[:, 0] + hh], dim=1)
    flips = torch.rand(batch_size, generator=generator) < hflip
    return CropParams(boxes, flips, _sizes(image_size, batch_size))


def crop_resize(x: Tensor, params: CropParams, size: tuple[int, int], padding: Padding = "zeros") -> Tensor:
    """Crop every sample's box out of ``x`` and resize it to ``size`` with RoIAlign, then flip.

    ``x`` may be the images themselves or any map that covers the whole image at a
    lower resolution (a score map): boxes in image pixels are scaled to ``x``'s cells.
    Each output cell averages bilinear samples (``ceil(bin size)`` per axis) of its bin.

    Args:
        x: ``(b, ch, hx, wx)`` float, covering each whole original image.
        params: the crops (boxes in original image pixels) and flips.
        size: ``(h, w)`` of the output.
        padding: what lies outside the image: ``"zeros"`` (padded images) or ``"border"``
            (the nearest cell: score maps, whose labels do not vanish at the border).

    Returns:
        ``(b, ch, h, w)`` in ``x``'s dtype.
    """
    from torchvision.ops import roi_align

    b, _, hx, wx = x.shape
    sizes = params.image_sizes.to(x.device).to(torch.float64)
    scale = torch.stack([wx / sizes[:, 1], hx / sizes[:, 0]] * 2, dim=1)
    boxes = params.boxes.to(x.device).to(torch.float64) * scale  # in cells of x
    lo = torch.stack([boxes[:, 0], boxes[:, 1]], dim=1)
    hi = torch.stack([boxes[:, 2] - wx, boxes[:, 3] - hx], dim=1)
    overhang = float(torch.cat([-lo, hi]).max()) if b else 0.0
    if overhang > 0:
        # roi_align clamps within one cell of the border and returns 0 beyond it; padding
        # explicitly gives every sample point its intended value (+1 for the bilinear neighbour).
        p = math.ceil(overhang) + 1
        x = F.pad(x, (p, p, p, p), mode="constant" if padding == "zeros" else "replicate")
        boxes = boxes + p
    rois = torch.cat([torch.arange(b, device=x.device, dtype=torch.float64).unsqueeze(1), boxes], dim=1)
    work = x if x.dtype in (torch.float32, torch.float64) else x.float()
    out: Tensor = roi_align(work, rois.to(work.dtype), output_size=size, spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    out = torch.where(params.flips.to(x.device).view(b, 1, 1, 1), out.flip(-1), out)
    return out.to(x.dtype)


def align_score_maps(
    maps: Tensor | TopKMaps, params: CropParams, grid: tuple[int, int], fill: Fill = "renormalize"
) -> Tensor:
    """Each sample's score map aligned to its crop and flip, on the token grid.

    RoIAlign of the map (the paper's choice) over the crop box; map regions outside the
    image take the nearest cell's scores. Alignment is linear and the output cells are
    convex combinations of map cells, so distributions stay distributions.

    Args:
        maps: dense ``(b, c, hm, wm)`` maps, or ``TopKMaps`` ``(b, hm, wm, k)`` (made dense
            first with ``fill``: fine at small ``c``; the memory is ``b c hm wm`` fp32).
        params: the crops and flips applied to the images.
        grid: ``(h, w)`` token grid of the model.

    Returns:
        ``(b, h, w, c)`` fp32 per-token class distributions of the un-mixed samples.
    """
    dense = rearrange(maps.dense(fill), "b hm wm c -> b c hm wm") if isinstance(maps, TopKMaps) else maps.float()
    return rearrange(crop_resize(dense, params, grid, padding="border"), "b c h w -> b h w c")


