"""Label convs as shifted sums under ``torch.compile`` (``compiled_label_convs``, ``shifted_conv``).

A compiled graph writes a label conv as a sum of the kernel's taps times shifted slices of the padded labels, which
the compiler fuses with the in-grid tap weight and the division; eager mode convolves. These tests hold that the
shifted sums are the convolution's sums (against float64 convolutions), that a compiled graph takes the route (no
convolution of labels left in it: a compiled TL-Align step has exactly the convolutions of a compiled NoAlign step)
and keeps eager's targets, that ``compiled_label_convs("conv")`` and kernels over ``_SHIFTED_TAPS`` taps keep the
convolution, and that a new batch does not retrace.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import mixlabels
from mixlabels import TLAlign, TokenLabelMap, backbones
from mixlabels.backbones._common import (
    _SHIFTED_TAPS, compiled_label_convs, conv_chain, conv_mix_pair, conv_steps_on_grid, launch_routes, shifted_conv,
)
from mixlabels.backbones._windows import as_grid
from mixlabels.backbones.families.efficientvit_mit import head_conv_mix
from test_fold import _float64_steps  # each step's depthwise conv in float64, divided by its in-grid tap weight

GEOMETRIES = [  # (kh, kw), padding, dilation
    ((3, 3), (1, 1), (1, 1)), ((5, 5), (2, 2), (1, 1)), ((3, 3), (2, 2), (2, 2)), ((1, 7), (0, 3), (1, 1)),
    ((7, 1), (3, 0), (1, 1)), ((7, 7), (3, 3), (1, 1)), ((2, 2), (0, 0), (1, 1)), ((3, 3), (0, 0), (1, 1)),
]


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("form", ["one kernel", "per channel", "from one channel"])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_shifted_conv_is_the_convolution(form: str, geometry: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]) -> None:
    (kh, kw), padding, dilation = geometry
    c, g = 3, 4
    y = _rand(2, 1 if form == "from one channel" else c, 9, 11, seed=1)
    kernel = _rand(kh, kw, seed=2) if form == "one kernel" else _rand(g if form == "from one channel" else c, kh, kw, seed=3)
    got = shifted_conv(y, kernel, padding, dilation)
    k64, y64 = kernel.double(), y.double()
    if form == "one kernel":
        want = F.conv2d(y64, k64.expand(c, 1, kh, kw), padding=padding, dilation=dilation, groups=c)
    elif form == "per channel":
        want = F.conv2d(y64, k64.unsqueeze(1), padding=padding, dilation=dilation, groups=c)
    else:
        want = F.conv2d(y64, k64.unsqueeze(1), padding=padding, dilation=dilation)
    assert got.shape == want.shape
    assert_close(got.double(), want, rtol=1e-6, atol=1e-7)  # the kernel is no distribution here: sums up to 49


class _Graphs:
    """A ``torch.compile`` backend that keeps every graph dynamo traces and runs it as traced."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        self.graphs.append(gm)
        return gm.forward

    def convs(self) -> int:
        return sum(1 for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function" and "conv" in str(n.target))


def _compiled(fn: Callable[..., torch.Tensor], *args: Any, route: str = "shifted") -> tuple[torch.Tensor, _Graphs]:
    torch._dynamo.reset()
    graphs = _Graphs()
    with compiled_label_convs(route):  # type: ignore[arg-type]
        out = torch.compile(fn, backend=graphs, fullgraph=True)(*args)
    return out, graphs


@pytest.mark.parametrize("geometry", GEOMETRIES[:6])
def test_compiled_label_convs_are_shifted_sums_equal_to_eager(geometry: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]) -> None:
    (kh, kw), padding, dilation = geometry
    y = _rand(3, 12 * 10, 2, seed=4)
    y = as_grid(y / y.sum(-1, keepdim=True), (12, 10))
    kernels = [k / k.sum() for k in (_rand(kh, kw, seed=s) for s in (5, 6))]
    steps = [(kernels[0], padding, dilation), (kernels[1].expand(2, 1, kh, kw), padding, dilation)]  # both kernel forms
    eager = conv_steps_on_grid(y, steps)
    got, graphs = _compiled(conv_steps_on_grid, y, steps)
    assert graphs.convs() == 0, "the compiled label convs are still convolutions"
    assert_close(got, eager, rtol=0, atol=1e-6)
    assert_close(got.double(), _float64_steps(y, [(k, padding, dilation) for k in kernels]), rtol=0, atol=1e-6)
    assert_close(got.sum(1), torch.ones(3, 12, 10), rtol=0, atol=1e-6)  # rows still sum to 1
    kept, graphs = _compiled(conv_steps_on_grid, y, steps, route="conv")
    assert graphs.convs() == 4  # each step's convolution and its in-grid tap weight's
    assert_close(kept, eager, rtol=0, atol=1e-6)


def test_small_grids_compiled_take_the_shifted_sums_not_the_tap_matrices() -> None:
    """Eager mode mixes a small grid's labels by tap matrices (products); compiled, by the same fused sums."""
    grid = (7, 7)
    labels = _rand(2, 49, 3, seed=13)
    labels = labels / labels.sum(-1, keepdim=True)
    k = _rand(3, 3, seed=14)
    steps = [(k / k.sum(), (1, 1), (1, 1)), (k.T / k.sum(), (2, 2), (2, 2))]
    got, graphs = _compiled(conv_chain, labels, grid, steps)
    products = sum(1 for gm in graphs.graphs for n in gm.graph.nodes if n.op == "call_function"
                   and any(name in str(n.target) for name in ("mm", "matmul", "bmm")))
    assert graphs.convs() == 0 and products == 0
    assert_close(got, conv_chain(labels, grid, steps), rtol=0, atol=1e-6)


@pytest.mark.parametrize("launch", [False, True], ids=["cpu routes", "launch routes"])
def test_small_grids_compiled_with_label_convs_as_convolutions_take_the_tap_matrices_in_one_graph(launch: bool) -> None:
    """``compiled_label_convs("conv")`` (``op_count.py --compiled``'s ``tlalign/conv``): a small grid's chain compiles
    to one graph of tap-matrix products, under a GPU's routes too (whose eager walk reads the tap matrices' own
    in-grid tap weights through strided views: a storage offset read while tracing broke the graph), with eager's
    targets."""
    grid = (7, 7)
    labels = _rand(2, 49, 3, seed=15)
    labels = labels / labels.sum(-1, keepdim=True)
    k = _rand(3, 3, seed=16)
    steps = [(k / k.sum(), (1, 1), (1, 1)), (k.T / k.sum(), (1, 1), (1, 1))]
    with (launch_routes() if launch else contextlib.nullcontext()), compiled_label_convs("conv"):
        got = torch.compile(conv_chain, fullgraph=True, backend="eager")(labels, grid, steps)
        eager = conv_chain(labels, grid, steps)
    torch._dynamo.reset()
    assert_close(got, eager, rtol=0, atol=1e-6)
    assert not torch.equal(got, labels)


def test_kernels_over_the_tap_limit_stay_convolutions() -> None:
    side = 9
    assert side * side > _SHIFTED_TAPS
    y = as_grid(_rand(2, 16 * 16, 2, seed=7), (16, 16))
    steps = [(_rand(side, side, seed=8), (4, 4), (1, 1))]
    got, graphs = _compiled(conv_steps_on_grid, y, steps)
    assert graphs.convs() >= 1
    assert_close(got, conv_steps_on_grid(y, steps), rtol=0, atol=1e-6)


def test_compiled_label_convs_refuses_an_unknown_route_and_restores_the_route() -> None:
    from mixlabels.backbones import _common

    with pytest.raises(ValueError, match="'shifted' or 'conv'"):
        with compiled_label_convs("fused"):  # type: ignore[arg-type]
            pass
    with pytest.raises(RuntimeError):
        with compiled_label_convs("conv"):
            assert not _common._SHIFTED[0]
            raise RuntimeError("inside")
    assert _common._SHIFTED[0]


def test_compiled_head_conv_mix_and_conv_mix_pair_are_shifted_sums_equal_to_eager() -> None:
    grid, n = (10, 9), 90
    labels = _rand(2, n, 3, seed=9)
    labels = labels / labels.sum(-1, keepdim=True)
    heads = _rand(4, 1, 5, 5, seed=10)
    args = (labels, grid, heads / heads.sum((2, 3), keepdim=True), (2, 2), (1, 1))
    got, graphs = _compiled(head_conv_mix, *args)
    assert graphs.convs() == 0
    assert_close(got, head_conv_mix(*args), rtol=0, atol=1e-6)
    other = _rand(2, n, 3, seed=11)
    k = _rand(3, 3, seed=12)
    pair = (labels, other / other.sum(-1, keepdim=True), grid, 0.3 * k / k.sum(), 0.7 * k.flip(0) / k.sum(), (1, 1), (1, 1))
    got, graphs = _compiled(conv_mix_pair, *pair)
    assert graphs.convs() == 0
    assert_close(got, conv_mix_pair(*pair), rtol=0, atol=1e-6)
    assert_close(got.sum(-1), torch.ones(2, n), rtol=0, atol=1e-6)


def _batch(size: int, seed: int) -> tuple[torch.Tensor, TokenLabelMap]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(4, 3, size, size, generator=g)
    mask = torch.ones(4, size, size)
    for i in range(3):  # a box per sample but the last, clipped where it runs over
        top, left = (int(v) for v in torch.randint(0, size - 8, (2,), generator=g))
        mask[i, top : top + 30, left : left + 35] = 0.0
    lm = TokenLabelMap.from_mask(mask, torch.tensor([1, 0, 3, 2]), torch.tensor([3, 7, 5, 1]), num_classes=10)
    return lm.mix_pixels(images), lm


_CONVOLVING = [
    "byobnet", "convmixer", "convnext", "cspnet", "edgenext", "efficientvit_mit", "fasternet", "fastvit", "ghostnet",
    "hgnet", "inception_next", "mambaout", "mobilenetv3", "nfnet", "repghost", "res2net", "resnest", "resnet",
    "resnetv2", "senet", "starnet", "tresnet", "tv_convnext", "tv_efficientnet", "tv_resnet", "vgg", "xception_aligned",
]
"""The families whose example convolves labels at 64 px (a grid over ``_DENSE_CONV_TOKENS`` positions): each of
the kinds of label conv (a block's depthwise convs, a stem's, EfficientViT's heads, MobileViT's fusion) in the
default run, the rest in the slow one."""
_DEFAULT = {"byobnet", "efficientvit_mit", "resnet", "convnext"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in _DEFAULT else pytest.mark.slow) for n in _CONVOLVING]
)
def test_a_compiled_tlalign_step_adds_no_convolution_and_equals_eager(name: str) -> None:
    family = next(f for f in backbones.FAMILIES if f.name == name)
    model = family.example().train()
    images, lm = _batch(64, seed=0)
    convs, outs = {}, {}
    for scheme in ("noalign", "tlalign"):
        torch._dynamo.reset()
        graphs = _Graphs()
        adapted = backbones.adapt(copy.deepcopy(model), TLAlign() if scheme == "tlalign" else mixlabels.NoAlign())
        compiled = torch.compile(adapted, backend=graphs, fullgraph=True)
        torch.manual_seed(0)  # each on its own copy: a training forward moves the norms' statistics, which kernels read
        outs[scheme] = compiled(images, lm)
        convs[scheme] = graphs.convs()
        if scheme == "tlalign":
            again, state = _batch(64, seed=1), copy.deepcopy(adapted.model)  # the statistics the next step reads
            with torch.compiler.set_stance("fail_on_recompile"):  # other boxes: no new trace
                torch.manual_seed(0)
                got = compiled(*again)
            torch.manual_seed(0)
            want = backbones.adapt(state, TLAlign())(*again)
            assert_close(got.target, want.target, rtol=0, atol=1e-6)
    assert convs["tlalign"] == convs["noalign"], "a compiled TL-Align step still convolves labels"
    torch.manual_seed(0)
    eager = backbones.adapt(copy.deepcopy(model), TLAlign())(images, lm)
    assert torch.equal(outs["tlalign"].logits, eager.logits)
    assert_close(outs["tlalign"].target, eager.target, rtol=0, atol=1e-6)
