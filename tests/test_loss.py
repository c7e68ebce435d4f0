"""Soft-target losses against timm's and a naive reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from timm.loss import SoftTargetCrossEntropy as TimmSoftTargetCrossEntropy
from torch.testing import assert_close

from mixlabels import (
    SoftTargetCrossEntropy,
    TokenSoftTargetCrossEntropy,
    soft_target_cross_entropy,
    token_soft_target_cross_entropy,
)


@given(st.integers(1, 8), st.integers(2, 40), st.integers(0, 2**31 - 1))
def test_soft_target_cross_entropy_equals_timm(b: int, c: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, c, generator=gen) * 3
    target = torch.rand(b, c, generator=gen).softmax(-1)
    assert_close(soft_target_cross_entropy(logits, target), TimmSoftTargetCrossEntropy()(logits, target))
    assert_close(SoftTargetCrossEntropy()(logits, target), TimmSoftTargetCrossEntropy()(logits, target))


def test_token_loss_is_the_mean_over_tokens_of_the_image_loss() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 7, generator=gen)
    target = torch.rand(3, 5, 7, generator=gen).softmax(-1)
    per_token = torch.stack([soft_target_cross_entropy(logits[:, n], target[:, n]) for n in range(5)])
    assert_close(token_soft_target_cross_entropy(logits, target), per_token.mean())
    assert_close(TokenSoftTargetCrossEntropy()(logits, target), per_token.mean())


def test_gradients_flow_to_logits_only() -> None:
    logits = torch.randn(2, 3, requires_grad=True)
    target = torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    soft_target_cross_entropy(logits, target).backward()
    assert logits.grad is not None
    # The gradient of soft CE is softmax(logits) - target, averaged over the batch.
    assert_close(logits.grad, (logits.detach().softmax(-1) - target) / 2)


def test_targets_that_need_grad_are_refused() -> None:
    target = torch.rand(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="must not require grad"):
        soft_target_cross_entropy(torch.randn(2, 3), target)
    with pytest.raises(ValueError, match="must not require grad"):
        token_soft_target_cross_entropy(torch.randn(2, 4, 3), torch.rand(2, 4, 3, requires_grad=True))


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="same|shape"):
        soft_target_cross_entropy(torch.randn(2, 3), torch.rand(2, 4))
    with pytest.raises(ValueError, match=r"\(b, n, c\)"):
        token_soft_target_cross_entropy(torch.randn(2, 3), torch.rand(2, 3))
