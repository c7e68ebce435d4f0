"""SaliencyMix (Uddin et al. 2021): the CutMix box, centred on the partner's saliency peak.

Sampling draws what is random (pairs, ``lam ~ Beta(alpha, alpha)``); placing
(``SaliencyMix.place``) reads the partners' pixels: the spectral-residual saliency
(Hou & Zhang 2007, the method the paper takes from OpenCV) of each partner, its
peak, and there the box of timm's ``rand_bbox`` for that lambda, clipped to the
image. The placed params are ordinary boxes: replaying them never looks at the
pixels again, and the label weight is the clipped box's true area.

The saliency is computed in torch on the images' device: grey levels, subsampled
to at most 64 x 64 (OpenCV's working size); ``log |F|`` minus its
3 x 3 mean, back with the original phase; squared magnitude, blurred by an
11 x 11 Gaussian of sigma 2.5, as OpenCV's ``StaticSaliencySpectralResidual``.
The official code boxes one partner's peak for the whole batch; here every
sample gets its own partner's peak.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mixlabels import BoxMask
from mixlabels._mask import _f32_scalar
from mixlabels._shape_cache import shape_cache
from mixlabels.strategies._base import MixParams, PairMixer
from mixlabels.strategies._cutmix import box_inside, box_mask, cutmix_boxes, grid_of
from mixlabels.strategies._host_draws import HostPairs, column, columns_on, draw_beta, sources_column, to_fp32
from mixlabels.strategies._mixup import check_alpha
from mixlabels.strategies._paste import apply_boxes
from mixlabels.strategies._sampling import MixSampler, Mode, Pairing, Pairs, sample_beta

__all__ = ["SaliencyMix", "SaliencyParams", "SaliencySampler", "spectral_residual_saliency", "saliency_peaks", "box_weights"]

WORK_SIZE = 64  # OpenCV's spectral-residual working resolution


@dataclass(frozen=True, eq=False, kw_only=True)
class SaliencyParams(MixParams):
    """SaliencyMix draws: lambdas, then (once placed on the pixels) the boxes.

    Attributes:
        lam: ``(b,)`` fp32 lambda drawn from Beta; 1 where unmixed.
        grid: ``(gh, gw)`` cells of the boxes.
        boxes: ``(b, 4)`` long ``(y0, y1, x0, x1)`` in cells, empty where unmixed; ``None`` until placed.
        box_reach: ``(b, 4)`` long, each box's corners from its centre (``cutmix_boxes``' sides of ``lam``), when
            the sampler computed them with its draws; ``None``: computed from ``lam`` when placed.
        box_bounds: ``(b, 2, 4)`` long, the corners' lower and upper clamps (0 and the grid; 0 and 0 where
            unmixed: an empty box), likewise.
    """

    lam: Tensor
    grid: tuple[int, int]
    boxes: Tensor | None = None
    box_reach: Tensor | None = None
    box_bounds: Tensor | None = None

    DERIVED: ClassVar[tuple[str, ...]] = (*MixParams.DERIVED, "box_reach", "box_bounds")

    def placed_boxes(self) -> Tensor:
        if self.boxes is None:
            raise ValueError(
                "these SaliencyMix params are not placed yet: the box centres come from the partners' pixels; "
                "call SaliencyMix.place(params, images) (calling the mixer on the images does it)"
            )
        return self.boxes

    def source_weight(self) -> Tensor:
        return box_mask(self.placed_boxes(), self.grid)

    def cell_boxes(self) -> tuple[Tensor, tuple[int, int]]:
        return self.placed_boxes(), self.grid

    def keep_cells(self) -> Tensor:
        return ~box_inside(self.placed_boxes(), self.grid)


@shape_cache(maxsize=16)
def _blur_matrix(n: int, size: int, sigma: float, device: torch.device) -> Tensor:
    """``(n, n)`` fp32 matrix of a 1-d Gaussian blur with replicated edges (rows: outputs)."""
    x = torch.arange(size, dtype=torch.float32, device=device) - (size - 1) / 2
    k = torch.exp(-(x * x) / (2 * sigma * sigma))
    k = k / k.sum()
    out = torch.arange(n, device=device)
    src = (out[:, None] + torch.arange(size, device=device)[None, :] - size // 2).clamp(0, n - 1)  # replicate
    return torch.zeros(n, n, dtype=torch.float32, device=device).scatter_add_(1, src, k.expand(n, size))


def _gaussian_blur(maps: Tensor, size: int = 11, sigma: float = 2.5) -> Tensor:
    """Separable Gaussian blur of ``(n, h, w)`` maps, edges replicated, as two small matrix products.

    (Small maps, any size: the edge handling is folded into the matrices; a convolution
    with padding would need the map to be larger than the kernel and is slower here.)
    """
    rows = _blur_matrix(maps.shape[1], size, sigma, maps.device)
    cols = _blur_matrix(maps.shape[2], size, sigma, maps.device)
    return rows @ maps @ cols.T


def spectral_residual_saliency(images: Tensor) -> Tensor:
    """Spectral-residual saliency of every image, ``(b, sh, sw)`` fp32 at the working size.

    The working size is ``ceil(H / ceil(H / 64))`` x ``ceil(W / ceil(W / 64))`` (at most 64 x 64): every
    ``f``-th pixel of the grey image.

    Example:
        >>> img = 0.2 * torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        >>> img[:, :, 20:26, 4:10] += 0.8  # a bright square on a textured background
        >>> s = spectral_residual_saliency(img)
        >>> s.shape, divmod(int(s[0].argmax()), s.shape[2])
        (torch.Size([1, 32, 32]), (23, 6))
    """
    hh, ww = images.shape[2:]
    fh, fw = -(-hh // WORK_SIZE), -(-ww // WORK_SIZE)  # ceil: at most WORK_SIZE samples a side
    # Every f-th pixel, at the window centres: like OpenCV's linear resize it reads a few pixels
    # a window, not all of them (averaging every pixel cost more than the rest of the mixer).
    grey = images[:, :, fh // 2 :: fh, fw // 2 :: fw].float().mean(dim=1)
    if grey.shape[0] == 0:  # an empty batch has no saliency (and MKL's FFT refuses a batch of 0)
        return grey
    spectrum = torch.fft.fft2(grey)
    log_amp = torch.log(spectrum.abs() + 1e-8)
    # 3 x 3 mean of the log amplitude, edges replicated
    smooth = F.avg_pool2d(F.pad(log_amp[:, None], (1, 1, 1, 1), mode="replicate"), 3, stride=1)[:, 0]
    residual = torch.polar(torch.exp(log_amp - smooth), torch.angle(spectrum))
    sal = torch.fft.ifft2(residual).abs() ** 2
    return _gaussian_blur(sal)


@shape_cache(maxsize=16)
def _peak_cells(size: tuple[int, int], grid: tuple[int, int], device: torch.device) -> Tensor:
    """``(sh * sw, 4)`` long: for every position of the saliency's working grid (row-major), the cell of ``grid`` its
    pixel lies in, as a box's corners take it ``(cy, cy, cx, cx)``; ``saliency_peaks``' arithmetic, a constant of the
    sizes."""
    (hh, ww), (gh, gw) = size, grid
    fh, fw = -(-hh // WORK_SIZE), -(-ww // WORK_SIZE)  # the subsampling of spectral_residual_saliency
    rows = [(py * fh + fh // 2) * gh // hh for py in range(len(range(fh // 2, hh, fh)))]
    cols = [(px * fw + fw // 2) * gw // ww for px in range(len(range(fw // 2, ww, fw)))]
    return torch.tensor([[r, r, c, c] for r in rows for c in cols], dtype=torch.long, device=device)


@shape_cache(maxsize=16)
def _weight_constants(device: torch.device) -> tuple[Tensor, Tensor]:
    """``(1, 2)`` fp32 ``[0, 1]`` and ``[1, -1]``: ``[lam, 1 - lam]`` is ``[0, 1] + lam * [1, -1]``, bit for bit."""
    return torch.tensor([[0.0, 1.0]], device=device), torch.tensor([[1.0, -1.0]], device=device)


def box_weights(boxes: Tensor, grid: tuple[int, int]) -> Tensor:
    """``(b, 2)`` fp32 ``[lam, 1 - lam]`` of boxes clipped to the grid (``0 <= y0 <= y1 <= gh``, likewise x): lam is the
    cells left to the sample over the cell count, one fp32 division, as ``BoxMask.source_mean`` on the CPU (the same
    bits on every device)."""
    n, b = grid[0] * grid[1], boxes.shape[0]
    if n > 2**24:  # counts past fp32's integers: the mask's own mean
        lam = BoxMask(boxes, grid).source_mean().view(b, 1)
    else:
        area = boxes.reshape(b, 2, 2).diff(dim=2).prod(dim=1)  # b 1: height times width
        lam = (n - area) / _f32_scalar(n)  # integers over an fp32 scalar: fp32 quotients (exact counts), one division
    base, sign = _weight_constants(boxes.device)
    return torch.addcmul(base, lam, sign)


def saliency_peaks(images: Tensor, grid: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Row and column (in cells of ``grid``) of every image's saliency peak, ``(b,)`` long each."""
    sal = spectral_residual_saliency(images)
    hh, ww = images.shape[2:]
    fh, fw = -(-hh // WORK_SIZE), -(-ww // WORK_SIZE)  # the subsampling of spectral_residual_saliency
    flat = sal.flatten(1).argmax(dim=1)
    py, px = flat // sal.shape[2], flat % sal.shape[2]
    # the peak's pixel in the image (the sampled window centre), then its cell
    cy = torch.div((py * fh + fh // 2) * grid[0], hh, rounding_mode="floor")
    cx = torch.div((px * fw + fw // 2) * grid[1], ww, rounding_mode="floor")
    return cy, cx


class SaliencySampler(MixSampler[SaliencyParams]):
    """Draws SaliencyMix lambdas (Beta, one per group); boxes are placed later from the pixels.

    Args:
        alpha: Beta(alpha, alpha) concentration, > 0.
        cell: cell size in pixels the box snaps to; ``None`` for pixels.
        mode, pairing, prob: see ``MixSampler``.
    """

    params_type = SaliencyParams
    host_draws = True

    def __init__(self, alpha: float = 1.0, cell: int | None = None, mode: Mode = "batch", pairing: Pairing = "flip", prob: float = 1.0) -> None:
        check_alpha(alpha)
        if cell is not None and cell < 1:
            raise ValueError(f"patch_size must be a positive number of pixels, got {cell}")
        super().__init__(mode, pairing, prob)
        self.alpha = float(alpha)
        self.cell = cell

    def __repr__(self) -> str:
        return f"alpha={self.alpha}, cell={self.cell}, {super().__repr__()}"

    def check_image_size(self, image_size: tuple[int, int]) -> None:
        super().check_image_size(image_size)
        grid_of(image_size, self.cell, "patch_size")

    def draw(self, pairs: Pairs, image_size: tuple[int, int], generator: torch.Generator | None, device: torch.device) -> SaliencyParams:
        grid = grid_of(image_size, self.cell, "patch_size")
        lam = sample_beta(self.alpha, pairs.num_groups, generator, device)[pairs.group]
        lam = torch.where(pairs.applied, lam, torch.ones_like(lam))
        return SaliencyParams(partner=pairs.partner, applied=pairs.applied, image_size=image_size, lam=lam, grid=grid)

    def draw_host(self, pairs: HostPairs, image_size: tuple[int, int], rng: random.Random, device: torch.device) -> SaliencyParams:
        """``draw``'s law with Python numbers (a lambda a group, rounded to fp32 as the tensor draw keeps it), and what
        they fix of the boxes before the pixels are seen: each box's corners from its centre (``cutmix_boxes``' sides,
        the same float64 arithmetic) and their clamps; one buffer with the label map's sources."""
        (gh, gw), b = grid_of(image_size, self.cell, "patch_size"), len(pairs.partner)
        lams = [to_fp32(draw_beta(self.alpha, rng)) for _ in range(pairs.num_groups)]
        lam = [lams[g] if a else 1.0 for g, a in zip(pairs.group, pairs.applied)]
        reach, bounds = [], []
        for v, a in zip(lam, pairs.applied):
            ratio = math.sqrt(1.0 - v)
            cut_h, cut_w = math.floor(gh * ratio), math.floor(gw * ratio)
            reach += [-(cut_h // 2), (cut_h + 1) // 2, -(cut_w // 2), (cut_w + 1) // 2]
            bounds += [0, 0, 0, 0, *((gh, gh, gw, gw) if a else (0, 0, 0, 0))]  # an unmixed sample: the empty box
        partner, applied, lam_t, sources, reach_t, bounds_t = columns_on(
            [
                column(pairs.partner, torch.int64), column(pairs.applied, torch.bool), column(lam, torch.float32),
                sources_column(pairs), column(reach, torch.int64, b, 4), column(bounds, torch.int64, b, 2, 4),
            ],
            device,
        )  # fmt: skip
        return SaliencyParams(
            partner=partner, applied=applied, image_size=image_size, lam=lam_t, grid=(gh, gw),
            label_sources=sources, box_reach=reach_t, box_bounds=bounds_t,
        )  # fmt: skip


class SaliencyMix(PairMixer[SaliencyParams]):
    """SaliencyMix as a kornia augmentation producing a ``TokenLabelMap`` (the map keeps the boxes).

    Args:
        num_classes: ``c``.
        alpha: Beta(alpha, alpha) concentration of lambda (the paper: 1).
        patch_size: snap boxes to this cell size (the token grid); ``None`` for pixel boxes.
        label_smoothing: in ``[0, 1)``.
        prob: probability of mixing, per batch, pair or sample according to ``mode``.
        mode: ``"batch"``, ``"pair"`` or ``"elem"``: which samples share lambda (each box sits on its own partner's peak).
        pairing: ``"flip"``, ``"derangement"`` or ``"roll"``.
        generator: default source of randomness.

    Example:
        >>> sm = SaliencyMix(num_classes=10, generator=torch.Generator().manual_seed(0))
        >>> mixed, lm = sm(torch.rand(2, 3, 16, 16), torch.tensor([3, 7]))
        >>> sm.last_params.boxes.shape, bool((lm.image_weights[:, 0] == lm.mask.dense()[:, 0].mean((1, 2))).all())
        (torch.Size([2, 4]), True)
    """

    def __init__(
        self,
        num_classes: int,
        alpha: float = 1.0,
        patch_size: int | None = None,
        label_smoothing: float = 0.0,
        prob: float = 1.0,
        mode: Mode = "batch",
        pairing: Pairing = "flip",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(SaliencySampler(alpha, patch_size, mode, pairing, prob), num_classes, label_smoothing, generator)

    def place(self, params: SaliencyParams, images: Tensor) -> SaliencyParams:
        """Box every sample at its partner's saliency peak (params already placed come back unchanged)."""
        if params.boxes is not None:
            return params
        params = params.current()
        partner = params.partner.to(images.device)
        if params.box_reach is None or params.box_bounds is None:  # tensor draws (or a replaced draw): from lam
            cy, cx = saliency_peaks(images.detach(), params.grid)  # every image once, then each sample reads its partner's
            boxes = cutmix_boxes(params.lam.to(images.device), cy[partner], cx[partner], params.grid)
            boxes = torch.where(params.applied.to(images.device)[:, None], boxes, torch.zeros_like(boxes))
            return dataclasses.replace(params, boxes=boxes.to(params.lam.device))
        # The sampler fixed each box's corners around its centre and their clamps: the pixels add only the centres
        # (every image's peak once, each sample its partner's, as cells from a table of the working grid), and the
        # label weights follow from the boxes where they are (a handful of launches on a GPU, no host sync).
        peaks = spectral_residual_saliency(images.detach()).flatten(1).argmax(dim=1)
        centres = _peak_cells((int(images.shape[2]), int(images.shape[3])), params.grid, images.device)[peaks[partner]]  # b 4
        bounds = params.box_bounds.to(images.device)
        boxes = torch.clamp(centres + params.box_reach.to(images.device), bounds[:, 0], bounds[:, 1])
        weights = box_weights(boxes, params.grid)
        # the boxes are draws now: drawn_from is recorded again, with them (the derived values came from the rest)
        return dataclasses.replace(
            params, boxes=boxes.to(params.lam.device), label_weights=weights.to(params.lam.device), drawn_from=None
        )

    def apply_images(self, images: Tensor, params: SaliencyParams) -> Tensor:
        """Paste each partner's box; on the CPU box by box (``apply_boxes``), elsewhere (traced, autograd) as one
        select."""
        out = apply_boxes(images, params)
        return super().apply_images(images, params) if out is None else out

