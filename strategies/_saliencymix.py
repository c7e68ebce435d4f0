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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mixlabels.strategies._base import MixParams, PairMixer
from mixlabels.strategies._cutmix import box_inside, box_mask, cutmix_boxes, grid_of
from mixlabels.strategies._mixup import check_alpha
from mixlabels.strategies._paste import fast_paths, paste_boxes, pixel_boxes
from mixlabels.strategies._sampling import MixSampler, Mode, Pairing, Pairs, sample_beta

__all__ = ["SaliencyMix", "SaliencyParams", "SaliencySampler", "spectral_residual_saliency", "saliency_peaks"]

WORK_SIZE = 64  # OpenCV's spectral-residual working resolution


@dataclass(frozen=True, eq=False, kw_only=True)
class SaliencyParams(MixParams):
    """SaliencyMix draws: lambdas, then (once placed on the pixels) the boxes.

    Attributes:
        lam: ``(b,)`` fp32 lambda drawn from Beta; 1 where unmixed.
        grid: ``(gh, gw)`` cells of the boxes.
        boxes: ``(b, 4)`` long ``(y0, y1, x0, x1)`` in cells, empty where unmixed; ``None`` until placed.
    """

    lam: Tensor
    grid: tuple[int, int]
    boxes: Tensor | None = None

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
        partner = params.partner.to(images.device)
        cy, cx = saliency_peaks(images.detach(), params.grid)  # every image once, then each sample reads its partner's
        boxes = cutmix_boxes(params.lam.to(images.device), cy[partner], cx[partner], params.grid)
        boxes = torch.where(params.applied.to(images.device)[:, None], boxes, torch.zeros_like(boxes))
        return dataclasses.replace(params, boxes=boxes.to(params.lam.device))

    def apply_images(self, images: Tensor, params: SaliencyParams) -> Tensor:
        """Paste each partner's box; on the CPU box by box, elsewhere (or traced) as one select."""
        if fast_paths(images):
            return paste_boxes(images, params.partner, pixel_boxes(params.placed_boxes(), params.grid, params.image_size))
        return super().apply_images(images, params)

