"""``backbones._reparam``: fold scales computed together, and identities added at the centre taps, bit for bit
what the one-at-a-time fold (timm's ``_fuse_bn_tensor``) computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks._op_counter import OpCounter
from mixlabels.backbones._reparam import add_centre, norm_scales, scaled, scales_of


def _norm(c: int, seed: int, eps: float = 1e-5, affine: bool = True) -> nn.BatchNorm2d:
    g = torch.Generator().manual_seed(seed)
    bn = nn.BatchNorm2d(c, eps=eps, affine=affine)
    bn.running_var.copy_(torch.rand(c, generator=g) * 3)
    if affine:
        bn.weight.data.copy_(torch.randn(c, generator=g))
    return bn


def _alone(bn: nn.BatchNorm2d) -> torch.Tensor:
    """timm's ``_fuse_bn_tensor``: ``std = (running_var + eps).sqrt(); t = gamma / std``."""
    gamma = bn.weight if bn.weight is not None else torch.ones_like(bn.running_var)
    return gamma.detach() / (bn.running_var + bn.eps).sqrt()


def test_norm_scales_together_have_the_bits_of_each_alone() -> None:
    norms = [_norm(c, i) for i, c in enumerate([8, 16, 3, 8, 40])] + [_norm(5, 9, eps=1e-3), _norm(7, 10, affine=False)]
    for got, bn in zip(norm_scales(norms), norms):
        assert torch.equal(got, _alone(bn))
    assert not any(s.requires_grad for s in norm_scales(norms))


def test_norm_scales_of_one_eps_cost_the_same_whatever_their_number() -> None:
    counts = []
    for n in (3, 30):
        norms = [_norm(8, i) for i in range(n)]
        with OpCounter() as counter:
            norm_scales(norms)
        counts.append(sum(counter.ops.values()))
    assert counts[0] == counts[1] <= 6, counts


def test_scales_of_keys_each_norm_once() -> None:
    a, b = _norm(4, 0), _norm(6, 1)
    s = scales_of([a, b, a])
    assert list(s) == [a, b] and torch.equal(s[a], _alone(a))


def test_a_module_without_running_statistics_is_refused() -> None:
    with pytest.raises(TypeError, match="no running variance"):
        norm_scales([nn.LayerNorm(4)])


def _identity(shape: tuple[int, int, int, int]) -> torch.Tensor:
    """The identity as timm's ``_fuse_bn_tensor`` writes it: ``[c, c % i, k//2, k//2] = 1``."""
    eye = torch.zeros(shape)
    for c in range(shape[0]):
        eye[c, c % shape[1], shape[2] // 2, shape[3] // 2] = 1.0
    return eye


@pytest.mark.parametrize("shape", [(6, 1, 3, 3), (6, 1, 7, 7), (4, 4, 3, 3), (8, 2, 5, 5), (6, 1, 1, 1)])
@pytest.mark.parametrize("alpha", [1.0, -1.0])
def test_add_centre_is_adding_the_scaled_identity_kernel(shape: tuple[int, int, int, int], alpha: float) -> None:
    g = torch.Generator().manual_seed(0)
    k, s = torch.randn(shape, generator=g), torch.randn(shape[0], generator=g)
    expected = k + _identity(shape) * s.view(-1, 1, 1, 1) if alpha == 1.0 else k - _identity(shape) * s.view(-1, 1, 1, 1)
    assert torch.equal(add_centre(k.clone(), s, alpha=alpha), expected)
    assert torch.equal(add_centre(k.clone(), 1.0, alpha=alpha), k + alpha * _identity(shape))


def test_add_centre_on_a_strided_kernel() -> None:
    k = torch.randn(3, 1, 3, 3).transpose(2, 3)  # a non-contiguous (3, 1, 3, 3): the index route
    assert not k.clone().is_contiguous()
    expected = k + _identity((3, 1, 3, 3)) * 2.0
    assert torch.equal(add_centre(k.clone(), 2.0), expected)


def test_scaled_multiplies_each_output_channel() -> None:
    w, s = torch.randn(4, 2, 3, 3), torch.randn(4)
    assert torch.equal(scaled(w, s), torch.stack([w[o] * s[o] for o in range(4)]))
