"""Soft-target losses: image-level and dense per-token cross entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "soft_target_cross_entropy",
    "token_soft_target_cross_entropy",
    "SoftTargetCrossEntropy",
    "TokenSoftTargetCrossEntropy",
]


def _check(logits: Tensor, target: Tensor, ndim: int, what: str) -> None:
    if not isinstance(logits, Tensor) or not isinstance(target, Tensor):
        raise TypeError(f"{what}: logits and targets must be tensors, got {type(logits).__name__} and {type(target).__name__}")
    if not logits.is_floating_point() or not target.is_floating_point():
        raise ValueError(
            f"{what}: logits and targets must be floating point, got {logits.dtype} and {target.dtype}; targets are "
            "class distributions (label_map.image_targets(), or F.one_hot(labels, c).float() for class ids)"
        )
    if logits.device != target.device:
        raise ValueError(
            f"{what}: logits are on {logits.device} but targets on {target.device}; move the targets with "
            "target.to(logits.device)"
        )
    if target.requires_grad:
        raise ValueError(
            "targets must not require grad: aligned labels are stop-gradient targets (Eq. 12); "
            "pass target.detach()"
        )
    if logits.ndim != ndim or logits.shape != target.shape:
        raise ValueError(
            f"{what}: logits and targets must both have shape {'(b, c)' if ndim == 2 else '(b, n, c)'}, "
            f"got logits {tuple(logits.shape)} and targets {tuple(target.shape)}"
        )


def soft_target_cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """Mean over the batch of ``-sum_c target * log_softmax(logits)``; equals timm's ``SoftTargetCrossEntropy``.

    Args:
        logits: ``(b, c)``.
        target: ``(b, c)`` class distributions, no grad.

    Returns:
        A scalar.
    """
    _check(logits, target, 2, "soft_target_cross_entropy")
    return torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()


def token_soft_target_cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """Dense soft cross entropy, averaged over batch and tokens (token labeling's auxiliary loss).

    Args:
        logits: ``(b, n, c)`` per-token class scores.
        target: ``(b, n, c)`` per-token class distributions, no grad.

    Returns:
        A scalar.
    """
    _check(logits, target, 3, "token_soft_target_cross_entropy")
    return torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()


class SoftTargetCrossEntropy(nn.Module):
    """Module form of ``soft_target_cross_entropy``."""

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return soft_target_cross_entropy(logits, target)


class TokenSoftTargetCrossEntropy(nn.Module):
    """Module form of ``token_soft_target_cross_entropy``."""

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return token_soft_target_cross_entropy(logits, target)
