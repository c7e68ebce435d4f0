"""Position-major labels and the folded label convs (the CPU's route for a conv net's labels on large grids).

On the CPU a depthwise conv over a label map's two or three channels runs a slow kernel; with the batch's labels
stored position-major (``position_major``) the same conv runs over ``b * l`` channels in one channels-last call
(``folded``). These tests hold that the fold changes nothing but rounding (against float64 convs and pools, and a
real model's targets against the unfolded walk and the reference path), that the layout lasts (one copy a
forward), and that the route is taken only where it is meant to be (eager CPU, not a GPU's count, not a compile).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from mixlabels import TLAlign, TokenLabelMap, TokenLabeling
from mixlabels import backbones
from mixlabels.backbones import _convnet
from mixlabels.backbones._common import conv_steps_on_grid, fold_route, launch_routes
from mixlabels.backbones._windows import as_grid, folded, is_position_major, pool_on_grid, position_major, unfolded


def _labels(b: int, grid: tuple[int, int], l: int, seed: int) -> torch.Tensor:
    """``(b, l, h, w)`` labels in their own layout (``as_grid`` of contiguous tokens), rows summing to 1."""
    g = torch.Generator().manual_seed(seed)
    y = torch.rand(b, grid[0] * grid[1], l, generator=g)
    return as_grid(y / y.sum(-1, keepdim=True), grid)


@settings(max_examples=20, deadline=None)
@given(b=st.integers(2, 4), l=st.integers(1, 3), h=st.integers(1, 9), w=st.integers(1, 9), seed=st.integers(0, 99))
def test_position_major_keeps_every_label_and_folds_into_a_channels_last_map(b: int, l: int, h: int, w: int, seed: int) -> None:
    y = _labels(b, (h, w), l, seed)
    pm = position_major(y)
    assert torch.equal(pm, y)  # the same labels, another memory layout
    assert is_position_major(pm) and not is_position_major(y)
    assert folded(y) is None  # only the position-major layout folds
    f = folded(pm)
    assert f is not None and f.shape == (1, b * l, h, w) and f.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(f[0], y.reshape(b * l, h, w))  # channel i*l + j is sample i's label j
    back = unfolded(f, b)
    assert torch.equal(back, pm) and is_position_major(back)
    assert not is_position_major(position_major(_labels(1, (h, w), l, seed)))  # a batch of one has nothing to fold


def _float64_steps(y: torch.Tensor, steps: list[tuple[torch.Tensor, tuple[int, int], tuple[int, int]]]) -> torch.Tensor:
    """Each step's depthwise conv in float64, divided by its in-grid tap weight: what ``conv_steps_on_grid`` computes."""
    z, l = y.double(), int(y.shape[1])
    for kernel, padding, dilation in steps:
        k = kernel.double().reshape(1, 1, *kernel.shape[-2:])
        mass = F.conv2d(torch.ones_like(z[:1, :1]), k, padding=padding, dilation=dilation)
        z = F.conv2d(z, k.expand(l, 1, -1, -1), padding=padding, dilation=dilation, groups=l) / mass
    return z


@pytest.mark.parametrize("kernel_form", ["kh kw", "l 1 kh kw", "(b l) 1 kh kw"])
@pytest.mark.parametrize("geometry", [((3, 3), (1, 1), (1, 1)), ((5, 5), (2, 2), (1, 1)), ((3, 3), (2, 2), (2, 2)), ((1, 7), (0, 3), (1, 1))])
def test_folded_label_convs_equal_float64_and_the_unfolded_convs(
    kernel_form: str, geometry: tuple[tuple[int, int], tuple[int, int], tuple[int, int]],
) -> None:
    (kh, kw), padding, dilation = geometry
    b, l, grid = 3, 2, (12, 10)
    y = _labels(b, grid, l, seed=kh * 10 + kw)
    g = torch.Generator().manual_seed(1)
    kernels = [torch.rand(kh, kw, generator=g) for _ in range(3)]
    kernels = [k / k.sum() for k in kernels]

    def as_given(k: torch.Tensor, channels: int) -> torch.Tensor:
        return k if kernel_form == "kh kw" else k.expand(channels, 1, kh, kw)

    channels = {"kh kw": 0, "l 1 kh kw": l, "(b l) 1 kh kw": b * l}[kernel_form]
    steps = [(as_given(k, channels), padding, dilation) for k in kernels]
    plain = conv_steps_on_grid(y, steps)
    pm = position_major(y)
    out = conv_steps_on_grid(pm, steps)
    assert is_position_major(out)  # the layout lasts: the next conv folds without a copy
    want = _float64_steps(y, [(k, padding, dilation) for k in kernels])
    assert_close(out.double(), want, rtol=0, atol=5e-7)
    assert_close(out, plain, rtol=0, atol=5e-7)
    assert_close(out.sum(1), torch.ones(b, *grid), rtol=0, atol=1e-6)  # rows still sum to 1


@pytest.mark.parametrize("ceil", [False, True])
def test_folded_pools_equal_the_unfolded_pools(ceil: bool) -> None:
    b, l, grid = 4, 3, (11, 9)
    y = _labels(b, grid, l, seed=5)
    axes = [((3, 2, 1, 1, ceil), (3, 2, 1, 1, ceil)), ((2, 2, 0, 0, ceil), (2, 2, 0, 0, ceil))]
    plain = pool_on_grid(y, axes, [ceil, ceil])
    out = pool_on_grid(position_major(y), axes, [ceil, ceil])
    assert is_position_major(out)
    want = y.double()
    for ((k, s, p, _, _), _), c in zip(axes, [ceil, ceil]):
        want = F.avg_pool2d(want, k, s, p, ceil_mode=c, count_include_pad=False)
    assert_close(out.double(), want, rtol=0, atol=1e-7)
    assert_close(out, plain, rtol=0, atol=1e-7)


def test_fold_route_only_where_the_copy_pays() -> None:
    cl = _labels(4, (16, 16), 2, seed=0)  # the labels' own channels-last view
    major = cl.contiguous()  # (b, l, h, w)-major memory: the layout a separable window leaves
    assert not fold_route(cl, 1)  # a copy for one conv on channels-last labels costs more than it saves
    assert fold_route(cl, 2) and fold_route(cl, 1, lasting=True)
    assert fold_route(major, 1)  # the grouped conv on this layout is many times slower than the copy
    assert not fold_route(position_major(cl), 5)  # already folded
    assert not fold_route(_labels(1, (16, 16), 2, seed=0), 5)  # a batch of one: nothing to fold
    assert fold_route(_labels(4, (16, 16), 7, seed=0), 5)
    assert not fold_route(_labels(4, (16, 16), 8, seed=0), 5)  # wider labels (token targets) convolve faster as they are
    with launch_routes():  # what a GPU would launch: no CPU route
        assert not fold_route(major, 5)
    assert not fold_route(cl.to("meta"), 5)


def _batch(size: int) -> tuple[torch.Tensor, TokenLabelMap]:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(4, 3, size, size, generator=g)
    mask = torch.ones(4, size, size)
    mask[0, 5:40, 9:50] = 0.0
    mask[1, 20:60, 0:27] = 0.0
    mask[2, 0:33, 31:64] = 0.0
    lm = TokenLabelMap.from_mask(mask, torch.tensor([1, 0, 3, 2]), torch.tensor([3, 7, 5, 1]), num_classes=10)
    return lm.mix_pixels(images), lm


_FOLDING = [
    "byobnet", "convmixer", "convnext", "cspnet", "edgenext", "efficientvit_mit", "fasternet", "fastvit", "ghostnet",
    "hgnet", "inception_next", "mambaout", "mobilenetv3", "nfnet", "regnet", "repghost", "res2net", "resnest", "resnet",
    "resnetv2", "senet", "starnet", "tresnet", "tv_convnext", "tv_efficientnet", "tv_regnet", "tv_resnet", "vgg",
    "xception_aligned",
]
"""The families whose example walks its labels through depthwise label convs at 64 px (a grid over
``_DENSE_CONV_TOKENS`` positions), so that their walk folds."""


@pytest.mark.parametrize("name", _FOLDING)
def test_a_conv_nets_folded_walk_copies_once_and_equals_the_unfolded_walk_and_the_reference(
    name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """64 px images: the examples' first grids (16x16, 32x32) take the depthwise route, so the walk folds, once."""
    family = next(f for f in backbones.FAMILIES if f.name == name)
    model = family.example().train()
    images, lm = _batch(64)
    copies: list[tuple[int, ...]] = []
    real = _convnet.position_major

    def spy(y: torch.Tensor) -> torch.Tensor:
        copies.append(tuple(y.shape))
        return real(y)

    monkeypatch.setattr(_convnet, "position_major", spy)
    torch.manual_seed(0)  # each forward on its own copy: a training forward moves the norms' running statistics,
    out = backbones.adapt(copy.deepcopy(model), TLAlign())(images, lm)  # which folded label kernels read
    assert copies, "the walk never folded: the test no longer reaches the folded route"
    assert len(copies) == 1, f"the labels lost the position-major layout between blocks: copied at {copies}"
    monkeypatch.setattr(_convnet, "fold_route", lambda *a, **k: False)
    torch.manual_seed(0)
    plain = backbones.adapt(copy.deepcopy(model), TLAlign())(images, lm)
    torch.manual_seed(0)
    ref = backbones.adapt(copy.deepcopy(model), TLAlign(), reference=True)(images, lm)
    assert torch.equal(out.logits, plain.logits)
    assert_close(out.target, plain.target, rtol=0, atol=1e-6)
    assert_close(out.target.double(), ref.target.double(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["resnet", "ghostnet", "convnext", "fastvit", "efficientvit_mit"])
def test_token_targets_through_a_folded_walk_equal_the_reference(name: str) -> None:
    """TokenLabeling(aligned=True) tracks the unaligned labels beside the aligned ones (the tracker's layout copy
    moves both); its token targets and image targets through the folded walk equal the reference path's."""
    family = next(f for f in backbones.FAMILIES if f.name == name)
    model = family.example().train()
    images, lm = _batch(64)
    scheme = TokenLabeling(aligned=True)
    torch.manual_seed(0)
    out = backbones.adapt(copy.deepcopy(model), scheme)(images, lm)
    torch.manual_seed(0)
    ref = backbones.adapt(copy.deepcopy(model), scheme, reference=True)(images, lm)
    assert out.token_target is not None and ref.token_target is not None
    assert_close(out.target.double(), ref.target.double(), rtol=0, atol=1e-6)
    assert_close(out.token_target.double(), ref.token_target.double(), rtol=0, atol=1e-6)
