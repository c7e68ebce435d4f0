"""MixUp: every pixel is ``lam * x + (1 - lam) * x[partner]``, ``lam ~ Beta(alpha, alpha)``."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from mixlabels.strategies._base import MixParams, PairMixer
from mixlabels.strategies._host_draws import HostPairs, column, columns_on, draw_beta, sources_column, to_fp32
from mixlabels.strategies._sampling import MixSampler, Mode, Pairing, Pairs, sample_beta

__all__ = ["MixUp", "MixUpParams", "MixUpSampler", "check_alpha"]


def check_alpha(alpha: float) -> None:
    """Raise unless ``alpha`` is a valid Beta concentration."""
    if not alpha > 0.0 or alpha != alpha or alpha == float("inf"):
        raise ValueError(f"alpha must be a finite number > 0 (the Beta(alpha, alpha) concentration), got {alpha}")


@dataclass(frozen=True, eq=False, kw_only=True)
class MixUpParams(MixParams):
    """MixUp draws: one lambda per sample (1 where unmixed).

    Attributes:
        lam: ``(b,)`` fp32 weight of the sample itself (timm's lambda).
        shared_lam: that weight as a Python number, when every sample has the same one and the sampler drew it on
            the host (``mode="batch"`` with every sample mixed, or none): the pixels are then blended with two
            scalars, as timm blends them, instead of per-sample weight tensors. ``None``: per sample (``lam``).
    """

    lam: Tensor
    shared_lam: float | None = None

    DERIVED: ClassVar[tuple[str, ...]] = (*MixParams.DERIVED, "shared_lam")

    def source_weight(self) -> Tensor:
        # a 1x1 mask: the coarsest exact resolution (a view: einops' pattern costs more host time than MixUp's math)
        return self.lam.float().view(-1, 1, 1)

    def image_weight(self) -> Tensor:
        return self.lam.float()

    def shared_weight(self) -> float | None:
        # Never while compiling: a Python number read off the params would be a constant of the trace, guarded on,
        # and so a recompile at every new lambda; the traced per-sample path computes the same pixels.
        return None if torch.compiler.is_compiling() else self.current().shared_lam


class MixUpSampler(MixSampler[MixUpParams]):
    """Draws Beta(alpha, alpha) lambdas, one per group.

    Args:
        alpha: Beta concentration, > 0.
        mode: ``"batch"``, ``"pair"`` or ``"elem"``.
        pairing: ``"flip"``, ``"derangement"`` or ``"roll"``.
        prob: probability of mixing per group.
    """

    params_type = MixUpParams
    host_draws = True

    def __init__(self, alpha: float = 0.8, mode: Mode = "batch", pairing: Pairing = "flip", prob: float = 1.0) -> None:
        check_alpha(alpha)
        super().__init__(mode, pairing, prob)
        self.alpha = float(alpha)

    def __repr__(self) -> str:
        return f"alpha={self.alpha}, {super().__repr__()}"

    def draw(self, pairs: Pairs, image_size: tuple[int, int], generator: torch.Generator | None, device: torch.device) -> MixUpParams:
        lam = sample_beta(self.alpha, pairs.num_groups, generator, device)[pairs.group]
        lam = torch.where(pairs.applied, lam, torch.ones_like(lam))
        return MixUpParams(partner=pairs.partner, applied=pairs.applied, image_size=image_size, lam=lam)

    def draw_host(self, pairs: HostPairs, image_size: tuple[int, int], rng: random.Random, device: torch.device) -> MixUpParams:
        drawn = [to_fp32(draw_beta(self.alpha, rng)) for _ in range(pairs.num_groups)] + [1.0]  # last: unmixed
        # The label map's values in fp32 as the CPU computes them: the 1x1 mask's mean is lam itself,
        # and 1 - lam is rounded once (in double, then to fp32: as fp32 subtraction rounds it).
        weight_rows = [(v, to_fp32(1.0 - v)) for v in drawn]
        picks = [g if a else len(drawn) - 1 for g, a in zip(pairs.group, pairs.applied)]
        lam, b = [drawn[r] for r in picks], len(picks)
        partner, applied, lam_t, sources, weights_t = columns_on(
            [
                column(pairs.partner, torch.int64), column(pairs.applied, torch.bool), column(lam, torch.float32),
                sources_column(pairs),
                column([w for r in picks for w in weight_rows[r]], torch.float32, b, 2),
            ],
            device,
        )  # fmt: skip
        return MixUpParams(
            partner=partner, applied=applied, image_size=image_size, lam=lam_t,
            any_unmixed=1.0 in lam,  # read on the host for free: the pixels skip a select when none is
            shared_lam=lam[0] if b and picks.count(picks[0]) == b else None,
            label_sources=sources, label_weights=weights_t, label_cells=weights_t.view(b, 2, 1, 1),
        )  # fmt: skip


class MixUp(PairMixer[MixUpParams]):
    """MixUp as a kornia augmentation producing a ``TokenLabelMap`` with a 1x1 mask.

    Args:
        num_classes: ``c``.
        alpha: Beta(alpha, alpha) concentration (timm's ``mixup_alpha``, DeiT uses 0.8).
        label_smoothing: in ``[0, 1)``, applied when the map expands targets.
        prob: probability of mixing, per batch, pair or sample according to ``mode``.
        mode: ``"batch"`` (one lambda), ``"pair"`` or ``"elem"``, as timm.
        pairing: ``"flip"`` (sample ``i`` with ``b - 1 - i``, timm), ``"derangement"`` or ``"roll"`` (``i`` with ``i - 1``, torchvision).
        generator: default source of randomness.

    Example:
        >>> mixup = MixUp(num_classes=10, generator=torch.Generator().manual_seed(0))
        >>> mixed, lm = mixup(torch.rand(4, 3, 8, 8), torch.tensor([1, 2, 3, 4]))
        >>> mixed.shape, lm.mask.dense().shape, lm.image_targets().shape
        (torch.Size([4, 3, 8, 8]), torch.Size([4, 2, 1, 1]), torch.Size([4, 10]))
    """

    def __init__(
        self,
        num_classes: int,
        alpha: float = 0.8,
        label_smoothing: float = 0.0,
        prob: float = 1.0,
        mode: Mode = "batch",
        pairing: Pairing = "flip",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(MixUpSampler(alpha, mode, pairing, prob), num_classes, label_smoothing, generator)
