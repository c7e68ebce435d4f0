"""FMix (Harris et al. 2020): binary masks from thresholded low-frequency Fourier noise.

Per draw: ``lam ~ Beta(alpha, alpha)``; a grey-noise image whose spectrum decays as
``1 / f ** decay_power`` (frequencies below ``1 / max(gh, gw)`` are clamped there, as
in the paper's code) is sampled on the cell grid; the ``round(lam * n)`` cells with
the highest noise keep the sample's own pixels, the rest come from the partner. The
mask is binary, so the label weight is the exact kept fraction.

The grid is the pixels (the paper) or ``cell_size`` cells (the mask then follows
the token grid: each token is entirely one image's).

Shapes: ``g`` groups (independent draws), ``gh gw`` mask grid, ``n = gh * gw``.
"""

from __future__ import annotations

import math
import random

import torch
from einops import rearrange
from torch import Tensor

from mixlabels import CellMask, TokenLabelMap
from mixlabels._shape_cache import shape_cache
from mixlabels.strategies._cutmix import grid_of
from mixlabels.strategies._host_draws import HostPairs, column, columns_on, draw_beta, sources_column, to_fp32
from mixlabels.strategies._mixup import check_alpha
from mixlabels.strategies._patch import CellMixer, CellParams
from mixlabels.strategies._paste import fast_paths, shared_cells
from mixlabels.strategies._sampling import MixSampler, Mode, Pairing, Pairs, sample_beta

__all__ = ["FMix", "FMixSampler", "fourier_noise", "top_cells"]


def fourier_noise(
    n: int, grid: tuple[int, int], decay_power: float, generator: torch.Generator | None, device: torch.device
) -> Tensor:
    """``n`` low-frequency noise images ``(n, gh, gw)`` float64: Gaussian spectra scaled by ``1 / f ** decay_power``.

    Example:
        >>> fourier_noise(2, (8, 6), 3.0, torch.Generator().manual_seed(0), torch.device("cpu")).shape
        torch.Size([2, 8, 6])
    """
    gh, gw = grid
    if n == 0:  # no draw to make (and MKL's FFT refuses a batch of 0)
        return torch.empty((0, gh, gw), dtype=torch.float64, device=device)
    parts = torch.randn((n, gh, gw // 2 + 1, 2), generator=generator, dtype=torch.float64, device=device)
    spectrum = torch.view_as_complex(parts * _spectrum_scale((gh, gw), float(decay_power), parts.device))
    noise: Tensor = torch.fft.irfft2(spectrum, s=(gh, gw))
    return noise


@shape_cache(maxsize=16)
def _spectrum_scale(grid: tuple[int, int], decay_power: float, device: torch.device) -> Tensor:
    """``(1, gh, fw, 1)`` float64 ``1 / f ** decay_power`` of the real spectrum's frequencies (a constant of the grid)."""
    gh, gw = grid
    fy = rearrange(torch.fft.fftfreq(gh, dtype=torch.float64, device=device), "gh -> gh 1")
    fx = rearrange(torch.fft.rfftfreq(gw, dtype=torch.float64, device=device), "fw -> 1 fw")
    freq = torch.sqrt(fy * fy + fx * fx)
    scale = freq.clamp(min=1.0 / max(gh, gw)).pow(-decay_power)  # the DC term gets the lowest frequency's scale
    return rearrange(scale, "gh fw -> 1 gh fw 1")


@shape_cache(maxsize=16)
def _rank_values(n: int, device: torch.device) -> Tensor:
    """``(1, n)`` fp32 ``0 .. n - 1``: the ranks ``noise_ranks`` scatters (exact integers in fp32 below 2 ** 24)."""
    return torch.arange(n, dtype=torch.float32, device=device)[None]


def noise_ranks(noise: Tensor) -> Tensor:
    """``(g, n)`` fp32: each cell's rank in its draw's descending order of noise (0: the highest), ties broken by
    position, as ``top_cells`` ranks them."""
    g, n = int(noise.shape[0]), math.prod(int(d) for d in noise.shape[1:])
    order = noise.reshape(g, n).argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty((g, n), dtype=torch.float32, device=noise.device)
    return ranks.scatter_(1, order, _rank_values(n, noise.device).expand(g, n))


def top_cells(noise: Tensor, keep: Tensor) -> Tensor:
    """``(g, gh, gw)`` bool: True for the cells outside the ``keep[i]`` highest values of ``noise[i]`` (the partner's).

    One sort per draw; ties (which continuous noise does not produce) are broken by position.
    """
    g, gh, gw = noise.shape
    order = noise.reshape(g, gh * gw).argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(gh * gw, device=noise.device).expand(g, gh * gw))
    return rearrange(ranks >= keep[:, None], "g (gh gw) -> g gh gw", gh=gh)


class FMixSampler(MixSampler[CellParams]):
    """Draws FMix masks: a Beta lambda and a Fourier noise image per group, thresholded at the lambda quantile.

    Args:
        alpha: Beta(alpha, alpha) concentration, > 0.
        decay_power: spectral decay ``delta`` (the paper: 3); larger means smoother, blobbier masks.
        cell_size: mask cell side in pixels; ``None`` for a per-pixel mask.
        mode, pairing, prob: see ``MixSampler``.
    """

    params_type = CellParams
    host_draws = True  # lambdas and pairs as Python numbers; the noise, per pixel, as a tensor (draw_host_and_pixels)

    def __init__(
        self,
        alpha: float = 1.0,
        decay_power: float = 3.0,
        cell_size: int | None = None,
        mode: Mode = "batch",
        pairing: Pairing = "flip",
        prob: float = 1.0,
    ) -> None:
        check_alpha(alpha)
        if not decay_power > 0 or decay_power == float("inf"):
            raise ValueError(f"decay_power must be a finite number > 0 (the spectrum falls as 1/f**decay_power), got {decay_power}")
        if cell_size is not None and cell_size < 1:
            raise ValueError(f"cell_size must be a positive number of pixels, got {cell_size}")
        super().__init__(mode, pairing, prob)
        self.alpha = float(alpha)
        self.decay_power = float(decay_power)
        self.cell_size = cell_size

    def __repr__(self) -> str:
        return f"alpha={self.alpha}, decay_power={self.decay_power}, cell_size={self.cell_size}, {super().__repr__()}"

    def check_image_size(self, image_size: tuple[int, int]) -> None:
        super().check_image_size(image_size)
        gh, gw = grid_of(image_size, self.cell_size, "cell_size")
        if gh * gw > 2**24:  # the cells' ranks and counts are fp32 integers (noise_ranks): exact up to 2 ** 24
            raise ValueError(
                f"FMix ranks its mask's cells in fp32, exact up to 2**24 cells; a {gh}x{gw} mask has {gh * gw}: "
                f"give a cell_size (e.g. the patch size) so the mask has fewer cells"
            )

    def draw(self, pairs: Pairs, image_size: tuple[int, int], generator: torch.Generator | None, device: torch.device) -> CellParams:
        grid = grid_of(image_size, self.cell_size, "cell_size")
        n = grid[0] * grid[1]
        lam = sample_beta(self.alpha, pairs.num_groups, generator, device)
        keep = torch.round(lam.double() * n).long()  # cells the sample keeps: the top-lam quantile of the noise
        noise = fourier_noise(pairs.num_groups, grid, self.decay_power, generator, device)
        cells = top_cells(noise, keep)[pairs.group] & pairs.applied[:, None, None]
        return CellParams(partner=pairs.partner, applied=pairs.applied, image_size=image_size, cells=cells, grid=grid)

    def draw_host(self, pairs: HostPairs, image_size: tuple[int, int], rng: random.Random, device: torch.device) -> CellParams:
        return self.draw_host_and_pixels(pairs, image_size, rng, None, device)

    def draw_host_and_pixels(
        self, pairs: HostPairs, image_size: tuple[int, int], rng: random.Random, generator: torch.Generator | None,
        device: torch.device,
    ) -> CellParams:
        """``draw``'s law: per group a lambda (a Python number, rounded to fp32 as the tensor draw keeps it) and a
        noise image (``fourier_noise``, from ``generator`` on its device, then on ``device``); the cells kept are the
        ``round(lam * n)`` of highest noise (``top_cells``, to the bit).

        What the host knows goes in one buffer with the partners: every sample's kept count (``n`` where unmixed),
        its label weights (the kept count over ``n``: the mask mean, one fp32 division) and sources. The device ranks
        the noise (a sort and a scatter) and compares the ranks with the counts once, for both label cells
        ``[kept, partner's]``: the keep and partner masks are views of that comparison. In ``mode="batch"`` with every
        sample mixed alike the cells are built once and expanded over the batch.
        """
        grid = grid_of(image_size, self.cell_size, "cell_size")
        (gh, gw), n, b = grid, grid[0] * grid[1], len(pairs.partner)
        keeps = [round(to_fp32(draw_beta(self.alpha, rng)) * n) for _ in range(pairs.num_groups)]  # half to even, as torch
        kept = [keeps[g] if a else n for g, a in zip(pairs.group, pairs.applied)]  # an unmixed sample keeps every cell
        shared = self.mode == "batch" and len(set(kept)) <= 1
        own_groups = pairs.group == list(range(b))  # mode "elem": every sample its own draw, ranks already in order
        rows = kept[:1] if shared else kept
        lams = [to_fp32(k / n) for k in kept]
        partner, applied, sources, weights, signs, bounds, group = columns_on(
            [
                column(pairs.partner, torch.int64), column(pairs.applied, torch.bool), sources_column(pairs),
                column([w for v in lams for w in (v, to_fp32(1.0 - v))], torch.float32, b, 2),
                # rank * sign < bound: kept where rank < k, the partner's where -rank < 1 - k (rank >= k)
                column([1.0, -1.0], torch.float32, 1, 2, 1),
                column([t for k in rows for t in (float(k), float(1 - k))], torch.float32, len(rows), 2, 1),
                column([] if self.mode == "batch" or own_groups else pairs.group, torch.int64),
            ],
            device,
        )  # fmt: skip
        noise_device = generator.device if generator is not None else device
        noise = fourier_noise(pairs.num_groups, grid, self.decay_power, generator, noise_device).to(device)
        ranks = noise_ranks(noise)
        if self.mode == "batch":
            ranks = ranks.expand(len(rows), n)
        elif not own_groups:
            ranks = ranks[group]
        both = torch.lt(ranks[:, None] * signs, bounds)  # rows 2 n: [kept, partner's]
        label_cells = both.float().view(len(rows), 2, gh, gw)
        keep, cells = both[:, 0].view(len(rows), gh, gw), both[:, 1].view(len(rows), gh, gw)
        if shared:
            keep, cells, label_cells = keep.expand(b, gh, gw), cells.expand(b, gh, gw), label_cells.expand(b, 2, gh, gw)
        return CellParams(
            partner=partner, applied=applied, image_size=image_size, cells=cells, grid=grid, keep=keep,
            label_sources=sources, label_weights=weights, label_cells=label_cells,
        )  # fmt: skip


class FMix(CellMixer):
    """FMix as a kornia augmentation producing a ``TokenLabelMap``: a smooth random binary mask.

    Args:
        num_classes: ``c``.
        alpha: Beta(alpha, alpha) concentration of lambda (the paper: 1).
        decay_power: spectral decay of the noise (the paper: 3).
        cell_size: mask cell side in pixels (e.g. the patch size, so no token is cut); ``None``: per pixel.
        label_smoothing: in ``[0, 1)``.
        prob: probability of mixing, per batch, pair or sample according to ``mode``.
        mode: ``"batch"``, ``"pair"`` or ``"elem"``; samples sharing a draw share the mask.
        pairing: ``"flip"``, ``"derangement"`` or ``"roll"``.
        generator: default source of randomness.

    Example:
        >>> fmix = FMix(num_classes=10, cell_size=4, generator=torch.Generator().manual_seed(0))
        >>> mixed, lm = fmix(torch.rand(2, 3, 16, 16), torch.tensor([3, 7]))
        >>> lm.mask.shape, bool((lm.image_weights[:, 0] == lm.mask.dense()[:, 0].mean((1, 2))).all())
        (torch.Size([2, 2, 4, 4]), True)
    """

    def __init__(
        self,
        num_classes: int,
        alpha: float = 1.0,
        decay_power: float = 3.0,
        cell_size: int | None = None,
        label_smoothing: float = 0.0,
        prob: float = 1.0,
        mode: Mode = "batch",
        pairing: Pairing = "flip",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(FMixSampler(alpha, decay_power, cell_size, mode, pairing, prob), num_classes, label_smoothing, generator)

    def label_map_from(self, params: CellParams, labels: Tensor) -> TokenLabelMap:
        """The map; on the CPU a per-pixel mask that every sample shares is stored once, expanded over the batch.

        (In ``mode="batch"`` with every sample mixed. Building ``(b, 2, H, W)`` copies of one
        mask cost about a quarter of timm's whole CutMix at 224 px; the weights are the same bits.)
        """
        params = params.current()
        if params.label_cells is None and fast_paths(labels) and params.cells.device.type == "cpu" and bool(params.applied.all()):
            cells = shared_cells(params)
            if cells is not None:
                b = params.batch_size
                w0 = (~cells).float()
                lam = w0.mean().expand(b)  # 0/1 cells: the sum is exact, so this is each row's mean to the bit
                return TokenLabelMap(
                    sources=torch.stack([torch.arange(b, device=labels.device), params.partner.to(labels.device).long()], dim=1),
                    mask=CellMask(torch.stack([w0, 1.0 - w0]).to(labels.device).expand(b, 2, *w0.shape)),
                    image_weights=torch.stack([lam, 1.0 - lam], dim=1).to(labels.device),
                    labels=labels,
                    num_classes=self.num_classes,
                    image_size=params.image_size,
                    label_smoothing=self.label_smoothing,
                    validated=True,  # 0/1 cells and their mean
                )
        return super().label_map_from(params, labels)
