"""TokenMix's mixing (Liu et al. 2022): random blocks of tokens from the partner, on the token grid.

TokenMix mixes two images token by token with a block-wise mask (BEiT's masking
generator) on the model's patch grid, at least 14 tokens per block, and lets
``lam ~ Beta(alpha, alpha)`` set the number of tokens taken: this is
``BlockwiseMix`` with ``cell_size`` fixed to the patch size and TokenMix's
smallest block. What TokenMix adds beyond the mask, targets from a pretrained
teacher's activation maps, is a labelling scheme, not a mixer, and is not done
here: the label weights are the exact token fractions, and TL-Align (or any
scheme) follows them through the network.
"""

from __future__ import annotations

import torch

from mixlabels.strategies._patch import BlockwiseMix
from mixlabels.strategies._sampling import Mode, Pairing

__all__ = ["TokenMix"]


class TokenMix(BlockwiseMix):
    """TokenMix's token mask as a kornia augmentation producing a ``TokenLabelMap``.

    Args:
        num_classes: ``c``.
        patch_size: the backbone's patch size: the blocks are made of its tokens.
        alpha: Beta(alpha, alpha) concentration of lambda; ``floor((1 - lam) * n)`` tokens are targeted.
        min_tokens: smallest block in tokens (TokenMix: 14 on a 14 x 14 grid).
        min_aspect: smallest block aspect ratio (BEiT's 0.3); the largest is its inverse.
        label_smoothing: in ``[0, 1)``.
        prob: probability of mixing, per batch, pair or sample according to ``mode``.
        mode: ``"batch"``, ``"pair"`` or ``"elem"``; samples sharing a draw share the mask.
        pairing: ``"flip"``, ``"derangement"`` or ``"roll"``.
        generator: default source of randomness.

    Example:
        >>> tm = TokenMix(num_classes=10, patch_size=2, min_tokens=4, generator=torch.Generator().manual_seed(0))
        >>> mixed, lm = tm(torch.rand(4, 3, 16, 16), torch.tensor([1, 2, 3, 4]))
        >>> lm.mask.shape  # one cell per token
        torch.Size([4, 2, 8, 8])
    """

    def __init__(
        self,
        num_classes: int,
        patch_size: int = 16,
        alpha: float = 1.0,
        min_tokens: int = 14,
        min_aspect: float = 0.3,
        label_smoothing: float = 0.0,
        prob: float = 1.0,
        mode: Mode = "batch",
        pairing: Pairing = "flip",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(num_classes, patch_size, alpha, None, min_tokens, None, min_aspect, None, label_smoothing, prob, mode, pairing, generator)

