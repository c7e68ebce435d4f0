"""MixToken (Token Labeling, section 3.3): CutMix on the token grid, applied to patch embeddings.

The images come back unmixed; the map is flagged ``token_space`` and its mask is
the binary token mask ``M`` of Eq. (5) (1 keeps the sample's own token). The
backbone adapter mixes the patch embeddings with ``TokenLabelMap.mix_tokens``, and
the class-token target uses the mask mean (Eq. 7), i.e. the corrected lambda.
"""

from __future__ import annotations

import torch

from mixlabels.strategies._base import PairMixer
from mixlabels.strategies._cutmix import BoxParams, BoxSampler
from mixlabels.strategies._sampling import Mode, Pairing

__all__ = ["MixToken"]


class MixToken(PairMixer[BoxParams]):
    """MixToken: a CutMix box on the ``patch_size`` token grid, mixed in token space.

    Boxes follow timm's ``rand_bbox`` on the token grid (the paper uses "the same way
    to generate the mask as CutMix"); lambda is always the box's true area.

    Args:
        num_classes: ``c``.
        alpha: Beta(alpha, alpha) concentration for the box size.
        patch_size: the backbone's patch size; must divide the image.
        label_smoothing: in ``[0, 1)``.
        prob: probability of mixing, per batch, pair or sample according to ``mode``.
        mode: ``"batch"``, ``"pair"`` or ``"elem"``.
        pairing: ``"flip"``, ``"derangement"`` or ``"roll"``.
        generator: default source of randomness.

    Example:
        >>> mixtoken = MixToken(num_classes=10, patch_size=4, generator=torch.Generator().manual_seed(0))
        >>> images = torch.rand(2, 3, 16, 16)
        >>> out, lm = mixtoken(images, torch.tensor([3, 7]))
        >>> out is images, lm.token_space, lm.mask.dense().shape
        (True, True, torch.Size([2, 2, 4, 4]))
    """

    def __init__(
        self,
        num_classes: int,
        alpha: float = 1.0,
        patch_size: int = 16,
        label_smoothing: float = 0.0,
        prob: float = 1.0,
        mode: Mode = "batch",
        pairing: Pairing = "flip",
        generator: torch.Generator | None = None,
    ) -> None:
        sampler = BoxSampler(alpha, None, True, patch_size, True, mode, pairing, prob)
        super().__init__(sampler, num_classes, label_smoothing, generator)
