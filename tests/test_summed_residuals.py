"""Summed residuals on a GPU's eager route (``CompactTracker.residual_sum``).

Where a residual's branch ends with a label conv on a large grid, its division by the in-grid tap weights and the
residual's mean (``lerp(y, mixed, 0.5)``) are one ``addcdiv``: ``y + c / m``, twice the mean, exactly. The tracker keeps
that power of two as the labels' scale and takes it out at the next event that needs the labels as they are (one
multiplication), or inside a block's folded matrix (``addmm``'s factors, no operator). Here: the tracker's events at a
scale against a tracker that divides and averages, the fallbacks (a dropped branch kept, TL-Align without
normalisation, the CPU's eager route, ``folded_residuals(False)``), conv families on a GPU's routes against their
reference, with a planted fault (the sum without its shortcut's labels) that the family check must catch, and a
downsampling block's strided 1x1 shortcut read by the sum as a view (bit for bit the pool it stands for).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_backbones_common import B, _fast_and_reference, cutmix_batch
from torch import Tensor
from torch.testing import assert_close

from benchmarks._op_counter import OpCounter
from mixlabels import TLAlign, TokenLayout, backbones
from mixlabels._trackers import CompactTracker
from mixlabels.backbones import _common, _convnet
from mixlabels.backbones._common import launch_routes

FAMILIES = {f.name: f for f in backbones.FAMILIES if f.name != "any"}
GRID = (4, 4)


def _pair(scheme: TLAlign) -> tuple[CompactTracker, CompactTracker]:
    _, lm = cutmix_batch()
    layout = TokenLayout(grid=GRID, num_prefix=0, depth=8, class_token=False)
    a, b = scheme.start(lm, layout), scheme.start(lm, layout)
    assert isinstance(a, CompactTracker) and isinstance(b, CompactTracker)
    return a, b


def _branch(seed: int) -> tuple[Tensor, Tensor]:
    """A conv's map left undivided: ``(raw, mass)`` with ``raw @ y / mass`` row-normalised (the division a conv's
    in-grid tap weights make), masses from 0.3 to 1 as at a grid's borders."""
    g = torch.Generator().manual_seed(seed)
    n = GRID[0] * GRID[1]
    normalised = torch.rand(n, n, generator=g)
    normalised = normalised / normalised.sum(-1, keepdim=True)
    mass = 0.3 + 0.7 * torch.rand(n, 1, generator=g)
    return normalised * mass, mass.view(1, n, 1)


def _summed_and_averaged(a: CompactTracker, b: CompactTracker, layer: int, seed: int, keep: Tensor | None = None) -> None:
    """One residual: ``a`` by ``residual_sum`` (the conv left undivided), ``b`` by ``residual`` of the divided map."""
    raw, mass = _branch(seed)
    held = a.labels_at_scale(layer)
    assert held is not None
    a.residual_sum(layer, keep, lambda: raw @ held / mass, lambda y: torch.addcdiv(y, raw @ held, mass))
    y = b.labels_for(layer)
    assert y is not None
    b.residual(layer, keep, mixed=raw @ y / mass)


def test_summed_residuals_keep_a_power_of_two_and_every_event_reads_the_labels_as_they_are() -> None:
    with launch_routes():
        a, b = _pair(TLAlign())
        for layer in range(3):
            _summed_and_averaged(a, b, layer, seed=layer)
        assert a._scale == 8.0  # three sums: the labels held at 2^3 times theirs
        held = a.labels_at_scale(3)
        assert held is not None
        assert_close(held, 8.0 * b.labels_for(3), rtol=1e-6, atol=1e-7)
        assert_close(a.labels_for(3), b.labels_for(3), rtol=1e-6, atol=1e-7)  # read as they are: one multiplication
        assert a._scale == 1.0
        _summed_and_averaged(a, b, 3, seed=3)
        fork_a, fork_b = a.fork(), b.fork()  # a fork holds the labels as they are
        assert fork_a.labels is not None and fork_b.labels is not None
        assert_close(fork_a.labels, fork_b.labels, rtol=1e-6, atol=1e-7)
        _summed_and_averaged(a, b, 4, seed=4)
        a.join(fork_a, 0.25, normalised=True)
        b.join(fork_b, 0.25, normalised=True)
        _summed_and_averaged(a, b, 5, seed=5)
        # a block's folded map takes the scale in its factors: ``mix`` is asked for the map times 1/2
        scales: list[float] = []

        def mix(y: Tensor, share: float, scale: float) -> Tensor:
            scales.append(scale)
            return scale * torch.lerp(y, y.flip(1), share)

        a.projected_by(6, lambda y: y, mix)
        b.projected_by(6, lambda y: y, mix)
        assert scales == [0.5, 1.0] and a._scale == 1.0
        _summed_and_averaged(a, b, 7, seed=7)
        assert a._scale == 2.0
        got, want = a.finish(), b.finish()  # the readout: as the labels are
        assert_close(got.target, want.target, rtol=1e-6, atol=1e-7)


def test_a_non_linear_aggregate_reads_the_labels_as_they_are() -> None:
    """``aggregate`` of a map not declared linear (it may renormalise inside, as an upsampling's labels do) gets the
    labels at their own scale; a linear one keeps the scale."""
    with launch_routes():
        a, b = _pair(TLAlign())
        _summed_and_averaged(a, b, 0, seed=0)
        a.aggregate(lambda y: y.flip(1), normalised=True, linear=True)
        b.aggregate(lambda y: y.flip(1), normalised=True)
        assert a._scale == 2.0
        seen: list[Tensor] = []
        a.aggregate(lambda y: seen.append(y) or y, normalised=True)  # type: ignore[func-returns-value]
        assert a._scale == 1.0
        assert_close(seen[0], b.labels_for(1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ["a dropped branch kept", "TL-Align without normalisation", "no sum"])
def test_residual_sum_falls_back_to_the_divided_residual(case: str) -> None:
    with launch_routes():
        a, b = _pair(TLAlign(normalize=case != "TL-Align without normalisation"))
        keep = torch.arange(B) % 2 == 0 if case == "a dropped branch kept" else None
        raw, mass = _branch(0)
        y = a.labels_at_scale(0)
        assert y is not None
        summed = None if case == "no sum" else (lambda held: torch.addcdiv(held, raw @ y, mass))
        a.residual_sum(0, keep, lambda: raw @ y / mass, summed)
        mine = b.labels_for(0)
        assert mine is not None
        b.residual(0, keep, mixed=raw @ mine / mass)
        assert a._scale == 1.0
        assert_close(a.labels_for(1), b.labels_for(1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ["summed", "a dropped branch kept", "TL-Align without normalisation"])
def test_a_shortcut_the_sum_takes_in_equals_its_aggregate_first(case: str) -> None:
    """``residual_sum(..., shortcut=s)``: the sum applies ``s`` to the labels itself; where it is not taken, the labels
    go through ``s`` first, as ``aggregate(s)`` and then the residual."""
    with launch_routes():
        a, b = _pair(TLAlign(normalize=case != "TL-Align without normalisation"))
        keep = torch.arange(B) % 2 == 0 if case == "a dropped branch kept" else None
        g = torch.Generator().manual_seed(5)
        n = GRID[0] * GRID[1]
        short = torch.rand(n, n, generator=g)
        short = short / short.sum(-1, keepdim=True)  # a row-normalised linear map: the shortcut's
        raw, mass = _branch(1)
        y = a.labels_at_scale(0)
        assert y is not None
        a.residual_sum(0, keep, lambda: raw @ y / mass, lambda held: torch.addcdiv(short @ held, raw @ y, mass),
                       shortcut=lambda held: short @ held)
        mine = b.labels_for(0)
        assert mine is not None
        b.aggregate(lambda held: short @ held, normalised=True)
        b.residual(0, keep, mixed=raw @ mine / mass)
        assert a._scale == (2.0 if case == "summed" else 1.0)
        assert_close(a.labels_for(1), b.labels_for(1), rtol=1e-6, atol=1e-7)


def test_residual_sum_refuses_a_layer_the_scheme_does_not_align() -> None:
    _, lm = cutmix_batch()
    tracker = TLAlign(layers=[0]).start(lm, TokenLayout(grid=GRID, num_prefix=0, depth=2, class_token=False))
    assert isinstance(tracker, CompactTracker)
    raw, mass = _branch(0)
    with pytest.raises(ValueError, match=r"residual_sum\(layer=1.*labels_for\(1\) is None"):
        tracker.residual_sum(1, None, lambda: torch.zeros(1), None)


class _Sums:
    """Counts ``residual_sum``'s offered sums, optionally planting a fault: the sum without its shortcut's labels."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, plant: bool = False) -> None:
        self.sums = 0
        self.through_shortcut = 0  # sums that take a downsampling block's shortcut in too (a strided view)
        real = CompactTracker.residual_sum

        def counted(tracker: CompactTracker, layer: int, keep: Tensor | None, divided: Callable[[], Tensor],
                    summed: Callable[[Tensor], Tensor] | None, shortcut: Callable[[Tensor], Tensor] | None = None) -> None:
            if summed is not None:
                self.sums += 1
                self.through_shortcut += shortcut is not None
                if plant:
                    whole = summed
                    summed = lambda y: whole(y) - (y if shortcut is None else shortcut(y))  # noqa: E731
            real(tracker, layer, keep, divided, summed, shortcut)

        monkeypatch.setattr(CompactTracker, "residual_sum", counted)


SUMMING = [
    "byobnet", "convmixer", "convnext", "cspnet", "davit", "edgenext", "efficientformer_v2", "efficientvit_mit",
    "efficientvit_msra", "metaformer", "mobilenetv3", "mobilenetv4", "nfnet", "pvt_v2", "regnet", "repghost", "resnest",
    "resnet", "resnetv2", "rexnet", "senet", "starnet", "tresnet", "tv_convnext", "tv_efficientnet", "tv_maxvit",
    "tv_mobilenet", "tv_regnet", "tv_resnet", "xception_aligned",
]
"""Conv families whose examples have residuals whose branch ends with a label conv: with every grid on the convs'
route (``large_grids``: the examples' 32 px grids are 16x16 and smaller, most within the matrices' 196 positions)."""


@pytest.fixture
def large_grids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every grid takes the label convs' route on a GPU's routes, as a 224 px model's 56x56 and 28x28 grids do."""
    monkeypatch.setattr(_common, "_DENSE_LAUNCH_TOKENS", 0)


@pytest.mark.parametrize("family", SUMMING)
@pytest.mark.parametrize("scheme", ["tl_align", "tokens_aligned"])
def test_summed_residuals_on_a_gpus_route_equal_the_reference(family: str, scheme: str, monkeypatch: pytest.MonkeyPatch, large_grids: None) -> None:
    sums = _Sums(monkeypatch)
    model = FAMILIES[family].example()
    with launch_routes():
        _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), scheme)
    assert sums.sums > 0, "no residual summed: this test checked nothing new"
    sums.sums = 0
    with launch_routes(), _convnet.folded_residuals(False):  # the fallback: divided, then the lerp
        _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), scheme)
    _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), scheme)  # the CPU's eager route
    assert sums.sums == 0


@pytest.mark.parametrize("family", ["resnet", "convnext"])
def test_a_sum_without_its_shortcut_fails_the_family_check(family: str, monkeypatch: pytest.MonkeyPatch, large_grids: None) -> None:
    sums = _Sums(monkeypatch, plant=True)
    model = FAMILIES[family].example()
    with launch_routes(), pytest.raises(AssertionError):
        _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), "tl_align")
    assert sums.sums > 0


@pytest.mark.parametrize("family", ["senet", "tv_resnet"])
def test_a_strided_1x1_shortcut_is_read_by_the_sum_as_a_view(family: str, monkeypatch: pytest.MonkeyPatch, large_grids: None) -> None:
    """A downsampling block whose shortcut is a strided 1x1 projection: its labels are the grid's every other row and
    column, which the sum reads as a strided view where a pool of 1x1 windows copied them (``_subsampling``): the
    same targets bit for bit (each window's mean of one position is that position), one ``avg_pool2d`` fewer a
    block."""
    sums = _Sums(monkeypatch)
    model = FAMILIES[family].example().eval()
    images, lm = cutmix_batch()

    def step() -> tuple[Tensor, Any, int]:
        adapted = backbones.adapt(copy.deepcopy(model), TLAlign())
        with launch_routes():
            adapted(images, lm)  # the shape caches and grid plans filled, as a GPU's after its first steps
            adapted(images, lm)
            with OpCounter() as counter:
                out = adapted(images, lm)
        return out.target, counter.ops, counter.kernels

    got, ops, kernels = step()
    viewed = sums.through_shortcut // 3
    assert viewed > 0, "no shortcut read as a view: this test checked nothing new"
    monkeypatch.setattr(_convnet, "_subsampling", lambda shortcut, grid: None)  # the pool, aggregated first
    want, pooled, pooled_kernels = step()
    assert torch.equal(got, want)
    assert pooled["avg_pool2d"] - ops.get("avg_pool2d", 0) == viewed
    assert pooled_kernels - kernels == viewed  # no copy instead: the sum's output lies as the tokens' view needs


def _kernels(model: torch.nn.Module, folded: bool, sums: _Sums) -> tuple[int, Any]:
    adapted = backbones.adapt(model, TLAlign())
    images, lm = cutmix_batch()
    with launch_routes(), _convnet.folded_residuals(folded):
        adapted(images, lm)  # the shape caches and grid plans filled, as a GPU's after its first steps
        adapted(images, lm)
        sums.sums = 0
        with OpCounter() as counter:
            adapted(images, lm)
    return counter.kernels, counter.ops


def test_a_summed_residual_launches_one_operator_where_the_division_and_lerp_took_two(monkeypatch: pytest.MonkeyPatch, large_grids: None) -> None:
    model = FAMILIES["resnet"].example().eval()
    sums = _Sums(monkeypatch)
    summed, ops = _kernels(model, True, sums)
    count = sums.sums
    assert count > 0 and ops["addcdiv"] == count
    # folded_residuals(False) also turns the matrices' folds off: compare the lerps and divisions on the large grid
    _, plain = _kernels(model, False, sums)
    assert plain["lerp"] - ops.get("lerp", 0) >= count
