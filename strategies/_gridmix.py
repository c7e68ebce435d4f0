"""GridMix / MaskMix: grid cells of a random scale taken from the partner.

MixPro's MaskMix (ICLR 2023) mixes with a patch-aligned grid mask whose cells are
larger than a patch; GridMix (Baek et al. 2021) mixes local grid cells of two
images. Here a draw picks a cell side ``s`` uniformly from ``cell_sizes`` (pixels),
``lam ~ Beta(alpha, alpha)``, and exactly ``floor((1 - lam) * n_s)`` of the
``n_s`` cells of side ``s`` come from the partner, uniformly at random (as
``RandomPatchMix`` on that grid). With one size it is ``RandomPatchMix``.

Draws of different sizes are expressed on one common grid, cells of the gcd of
the sizes, so one mask serves every sample and is exact.

Shapes: ``g`` groups (independent draws), ``gh gw`` common grid.
"""

from __future__ import annotations

import math
import random

import torch
from einops import rearrange, repeat
from torch import Tensor

from mixlabels.strategies._cutmix import grid_of
from mixlabels.strategies._host_draws import HostPairs, draw_beta, to_fp32
from mixlabels.strategies._mixup import check_alpha
from mixlabels.strategies._patch import CellMixer, CellParams, host_cell_params
from mixlabels.strategies._sampling import MixSampler, Mode, Pairing, Pairs, sample_beta, sample_uniform

__all__ = ["GridMix", "GridSampler"]


class GridSampler(MixSampler[CellParams]):
    """Draws a cell size, a Beta lambda and the partner's cells per group.

    Args:
        cell_sizes: candidate cell sides in pixels, each dividing the image.
        alpha: Beta(alpha, alpha) concentration, > 0.
        mode, pairing, prob: see ``MixSampler``.
    """

    params_type = CellParams
    host_draws = True

    def __init__(
        self,
        cell_sizes: tuple[int, ...] = (16, 32),
        alpha: float = 1.0,
        mode: Mode = "batch",
        pairing: Pairing = "flip",
        prob: float = 1.0,
    ) -> None:
        check_alpha(alpha)
        sizes = tuple(int(s) for s in cell_sizes)
        if not sizes or any(s < 1 for s in sizes) or len(set(sizes)) != len(sizes):
            raise ValueError(f"cell_sizes must be distinct positive numbers of pixels (at least one), got {cell_sizes}")
        super().__init__(mode, pairing, prob)
        self.cell_sizes = sizes
        self.alpha = float(alpha)
        self.unit = math.gcd(*sizes)  # the common grid's cell side

    def __repr__(self) -> str:
        return f"cell_sizes={self.cell_sizes}, alpha={self.alpha}, {super().__repr__()}"

    def check_image_size(self, image_size: tuple[int, int]) -> None:
        super().check_image_size(image_size)
        for s in self.cell_sizes:
            grid_of(image_size, s, "cell size")

    def draw(self, pairs: Pairs, image_size: tuple[int, int], generator: torch.Generator | None, device: torch.device) -> CellParams:
        g = pairs.num_groups
        grid = grid_of(image_size, self.unit, "cell size")
        choice = torch.floor(sample_uniform((g,), generator, device) * len(self.cell_sizes)).long()
        lam = sample_beta(self.alpha, g, generator, device)
        cells = torch.zeros((g, *grid), dtype=torch.bool, device=device)
        # Every size is drawn for every group (a few small sorts), then each group keeps its own size's:
        # the number of draws does not depend on the choices, and nothing waits on the host.
        for k, s in enumerate(self.cell_sizes):
            sh, sw = image_size[0] // s, image_size[1] // s
            count = torch.floor((1.0 - lam.double()) * (sh * sw)).long()
            noise = sample_uniform((g, sh * sw), generator, device)
            ranks = noise.argsort(dim=1).argsort(dim=1)  # a uniformly random order of the cells
            coarse = rearrange(ranks < count[:, None], "g (sh sw) -> g sh sw", sh=sh)
            fine = repeat(coarse, "g sh sw -> g (sh fh) (sw fw)", fh=s // self.unit, fw=s // self.unit)
            cells = torch.where(rearrange(choice == k, "g -> g 1 1"), fine, cells)
        cells = cells[pairs.group] & pairs.applied[:, None, None]
        return CellParams(partner=pairs.partner, applied=pairs.applied, image_size=image_size, cells=cells, grid=grid)

    def draw_host(self, pairs: HostPairs, image_size: tuple[int, int], rng: random.Random, device: torch.device) -> CellParams:
        """``draw``'s law with Python numbers: per group a size, a lambda (rounded to fp32, as the tensor draw keeps
        it) and a uniform subset of that size's cells, spread onto the common grid; one buffer with the label map's
        values (``host_cell_params``)."""
        grid = grid_of(image_size, self.unit, "cell size")
        rows = []
        for _ in range(pairs.num_groups):
            s = self.cell_sizes[min(math.floor(rng.random() * len(self.cell_sizes)), len(self.cell_sizes) - 1)]
            lam = to_fp32(draw_beta(self.alpha, rng))
            sh, sw = image_size[0] // s, image_size[1] // s
            n, count = sh * sw, math.floor((1.0 - lam) * (sh * sw))
            # a uniform subset of count cells; past half of them, the complement of a uniform subset of the rest (the
            # same law, half the Python draws at most)
            flip = count > n - count
            coarse = bytearray(b"\x01" * n if flip else bytes(n))  # row-major, 1: the partner's
            for i in rng.sample(range(n), n - count if flip else count):
                coarse[i] = 0 if flip else 1
            rows.append(_spread(bytes(coarse), sh, s // self.unit))
        return host_cell_params(pairs, rows, image_size, grid, device)


def _spread(coarse: bytes, rows: int, f: int) -> bytes:
    """Row-major 0/1 bytes of ``rows`` rows of cells as the common grid's, each cell ``f`` x ``f`` common cells: each
    byte repeated ``f`` times along its row, each row ``f`` times (bytes work, in C, not a Python step a cell).

    Example:
        >>> _spread(bytes([1, 0, 0, 1]), 2, 2).hex()
        '01010000010100000000010100000101'
    """
    if f == 1:
        return coarse
    wide = coarse.replace(b"\x00", b"\x00" * f).replace(b"\x01", b"\x01" * f)  # zeros first: ones stay single
    width = len(wide) // rows
    return b"".join(wide[y * width : (y + 1) * width] * f for y in range(rows))


class GridMix(CellMixer):
    """GridMix / MaskMix as a kornia augmentation producing a ``TokenLabelMap``: random cells of a random size.

    Args:
        num_classes: ``c``.
        cell_sizes: candidate cell sides in pixels (e.g. 1, 2 and 4 patches); each must divide the image.
        alpha: Beta(alpha, alpha) concentration of lambda; ``floor((1 - lam) * n)`` cells come from the partner.
        label_smoothing: in ``[0, 1)``.
        prob: probability of mixing, per batch, pair or sample according to ``mode``.
        mode: ``"batch"``, ``"pair"`` or ``"elem"``; samples sharing a draw share size and cells.
        pairing: ``"flip"``, ``"derangement"`` or ``"roll"``.
        generator: default source of randomness.

    Example:
        >>> gm = GridMix(num_classes=10, cell_sizes=(4, 8), generator=torch.Generator().manual_seed(0))
        >>> mixed, lm = gm(torch.rand(2, 3, 16, 16), torch.tensor([3, 7]))
        >>> lm.mask.shape  # the common grid: 4 px cells
        torch.Size([2, 2, 4, 4])
    """

    def __init__(
        self,
        num_classes: int,
        cell_sizes: tuple[int, ...] = (16, 32),
        alpha: float = 1.0,
        label_smoothing: float = 0.0,
        prob: float = 1.0,
        mode: Mode = "batch",
        pairing: Pairing = "flip",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(GridSampler(cell_sizes, alpha, mode, pairing, prob), num_classes, label_smoothing, generator)

