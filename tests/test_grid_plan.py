"""A GPU's eager route builds a forward's label-conv tap weights and matrices on every grid at once (``GridPlan``).

Where every operator is a launch, a CNN's label convs on large grids divide by their in-grid tap weights (one
convolution of ones per grid and kernel group) and on small grids mix by matrices (one product and one division
per grid and group). An adapter keeps which grids each group was asked for, per input size; the next forward of
that size builds each group on all of them in one call. Here: the joint builds against each grid's own; a real
ResNet-18's second forward dispatching fewer operators with the same targets, and the reference's; another input
size, the CPU's eager route and compiled graphs building grid by grid; and the controls (a canvas without its
gutters, a plan that forgot a grid).
"""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from benchmarks._op_counter import OpCounter
from mixlabels import NoAlign, TLAlign, TokenLabelMap
from mixlabels.backbones import _common, _convnet, _grid_plan, adapt
from mixlabels.backbones._common import (
    keeps_grid, labels_on_grids, launch_routes, tap_matrices_for, tap_mixes,
)

GEOMETRIES = {"3x3": ((3, 3), (1, 1), (1, 1)), "5x5 dilated": ((5, 5), (4, 4), (2, 2)), "1x5": ((1, 5), (0, 2), (1, 1))}


def _kernels(shape: tuple[int, int], count: int, seed: int) -> torch.Tensor:
    k = torch.rand(count, 1, *shape, generator=torch.Generator().manual_seed(seed)) + 0.01
    return k / k.sum(dim=(-2, -1), keepdim=True)


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_masses_and_matrices_on_many_grids_equal_each_grids_own(geometry: str) -> None:
    """One product and one division: every large grid's in-grid tap weights as a convolution of ones on that grid
    alone makes them, every small grid's matrices as ``tap_mixes`` with that grid's own tap matrices."""
    shape, padding, dilation = GEOMETRIES[geometry]
    stacked = _kernels(shape, 5, seed=len(geometry))
    rows = stacked.view(5, -1)
    large = [(16, 16), (9, 13), (8, 8)]
    small = [(7, 7), (4, 4), (2, 3)]
    for matrix_grids, mass_grids in ((small, large), (small, []), ([], large), (small[1:2], large[:1])):
        matrices, masses = labels_on_grids(rows, matrix_grids, mass_grids, shape, padding, dilation)
        assert len(matrices) == len(matrix_grids) and len(masses) == len(mass_grids)
        for got, (h, w) in zip(masses, mass_grids, strict=True):
            own = F.conv2d(torch.ones(1, 1, h, w), stacked, padding=padding, dilation=dilation).unbind(1)
            assert len(got) == 5
            for a, b in zip(got, own, strict=True):
                assert a.shape == (1, h, w)
                assert_close(a, b, rtol=0.0, atol=1e-7)
            assert (got[0] < 1 - 1e-3).any()  # the borders' weights are below 1: each grid's own borders
        for got_m, grid in zip(matrices, matrix_grids, strict=True):
            n = grid[0] * grid[1]
            own_m = tap_mixes(rows, tap_matrices_for(grid, shape, padding, dilation, rows.device), (5, n, n))
            assert_close(got_m, own_m, rtol=1e-6, atol=1e-7)
            assert_close(got_m.sum(-1), torch.ones(5, n))


def test_each_grids_masses_are_its_own() -> None:
    """The control: the masses of two grids of different sizes built together differ from each other where their
    borders differ (a mass grid read at another's offset would not), and a grid's interior weighs 1."""
    stacked = _kernels((3, 3), 5, seed=3)
    _, (a, b) = labels_on_grids(stacked.view(5, -1), [], [(8, 8), (6, 9)], (3, 3), (1, 1), (1, 1))
    assert_close(a[2][0, 1:-1, 1:-1], torch.ones(6, 6))
    assert_close(b[2][0, 1:-1, 1:-1], torch.ones(4, 7))
    assert_close(a[2][0, 0, 0], stacked[2, 0, 1:, 1:].sum())  # the corner reads its 2x2 in-grid taps
    assert keeps_grid((3, 3), (1, 1), (1, 1)) and not keeps_grid((3, 3), (0, 0), (1, 1))


class _Joint:
    """Counts the joint builds (``labels_on_grids``) that ``Kernels`` calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = {"labels_on_grids": 0}
        for name in self.calls:
            real = getattr(_convnet, name)

            def counted(*args: Any, _name: str = name, _real: Any = real) -> Any:
                self.calls[_name] += 1
                return _real(*args)

            monkeypatch.setattr(_convnet, name, counted)


def _batch(size: int) -> tuple[torch.Tensor, TokenLabelMap]:
    g = torch.Generator().manual_seed(size)
    mask = torch.ones(2, size, size)
    mask[0, 5 : size // 2, 9 : size - 3] = 0.0
    mask[1, size // 3 :, : size // 2 + 1] = 0.0
    lm = TokenLabelMap.from_mask(mask, torch.tensor([1, 0]), torch.tensor([3, 7]), num_classes=10)
    return lm.mix_pixels(torch.randn(2, 3, size, size, generator=g)), lm


def _resnet18() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("resnet18", pretrained=False, num_classes=10)


def _planned_resnet(monkeypatch: pytest.MonkeyPatch) -> tuple[_Joint, torch.Tensor, TokenLabelMap, torch.nn.Module]:
    """ResNet-18 adapted for TL-Align, matrices up to 16 positions (its 4x4 and 2x2 grids at 64 px), the joint
    builds counted, and a 64 px batch."""
    monkeypatch.setattr(_common, "_DENSE_LAUNCH_TOKENS", 16)
    joint = _Joint(monkeypatch)
    images, lm = _batch(64)
    return joint, images, lm, adapt(_resnet18(), TLAlign())


def test_a_second_forward_builds_every_grid_it_planned_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """ResNet-18 at 64 px on a GPU's routes, matrices up to 16 positions: its 3x3 convs' tap weights on the 16x16
    and 8x8 grids, and their matrices on 4x4 and 2x2. The first forward builds each grid alone; the next ones all
    four in one product and one division. Counted warm (the shape caches filled, as on a GPU after its first
    steps), against a forward built grid by grid (``grid_plans(False)``): both convolutions of ones for the masses
    and a product and a division for the matrices fewer, the same targets to rounding, and the reference's."""
    joint, images, lm, fast = _planned_resnet(monkeypatch)
    reference = adapt(_resnet18(), TLAlign(), reference=True)
    with launch_routes():
        with _grid_plan.grid_plans(False):
            fast(images, lm)  # warm: the shape caches
            with OpCounter() as by_grid:
                a = fast(images, lm)
        assert "_grid_plans" not in vars(fast)
        fast(images, lm)  # learns the plan
        assert joint.calls == {"labels_on_grids": 0}  # no plan yet: grid by grid
        fast(images, lm)  # the first planned forward: the joint builds' shape caches filled
        assert joint.calls == {"labels_on_grids": 1}, joint.calls
        with OpCounter() as planned:
            b = fast(images, lm)
        assert joint.calls == {"labels_on_grids": 2}, joint.calls
    fewer = by_grid.ops - planned.ops
    assert (fewer["convolution"], fewer["mm"], fewer["div"]) == (2, 1, 1), (fewer, planned.ops - by_grid.ops)
    assert by_grid.kernels - planned.kernels == 4  # those four, and no computing operator more (views move: slices)
    assert_close(b.target, a.target, rtol=1e-6, atol=1e-6)
    want = reference(images, lm)
    assert_close(b.target, want.target, rtol=1e-5, atol=1e-5)
    assert_close(b.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(b.target, adapt(_resnet18(), NoAlign())(images, lm).target, atol=1e-4)  # the labels moved

    other, other_lm = _batch(96)  # another input size: its own plan, built grid by grid on its first forward
    with launch_routes():
        c = fast(other, other_lm)
    assert joint.calls == {"labels_on_grids": 2}
    assert_close(c.target, reference(other, other_lm).target, rtol=1e-5, atol=1e-5)
    assert len(vars(fast)["_grid_plans"]) == 2


def test_a_plan_that_forgot_a_grid_builds_it_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan is a hint, not a promise: grids it does not hold are built as they are asked (a forward after a change
    of the model, or one that reaches a grid the last one did not), with the same targets."""
    joint, images, lm, fast = _planned_resnet(monkeypatch)
    with launch_routes():
        a = fast(images, lm)
        plans = vars(fast)["_grid_plans"]
        plan = plans[(64, 64)]
        # every group's first large grid alone, and none of its small ones: nothing to build together
        plans[(64, 64)] = {key: grids[:1] for key, grids in plan.items() if key[0] == "mass"}
        b = fast(images, lm)
    assert joint.calls == {"labels_on_grids": 0}
    assert_close(b.target, a.target, rtol=1e-6, atol=1e-6)
    assert vars(fast)["_grid_plans"][(64, 64)] == plan  # the asks, learnt again


def test_the_cpus_eager_route_builds_grid_by_grid_and_keeps_no_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the launch routes (the CPU's eager route, whose bits the targets digest holds) no plan is kept or read."""
    joint, images, lm, fast = _planned_resnet(monkeypatch)
    a, b = fast(images, lm), fast(images, lm)
    assert joint.calls == {"labels_on_grids": 0}
    assert "_grid_plans" not in vars(fast)
    assert torch.equal(a.target, b.target)


def test_grid_plans_off_builds_grid_by_grid_on_a_gpus_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """``grid_plans(False)`` (``gpu_suite --family-routes plans=off``, the fallback timed beside the plan): no plan is
    read or kept, and the targets are the planned forward's."""
    joint, images, lm, fast = _planned_resnet(monkeypatch)
    with launch_routes():
        a = fast(images, lm)
        with _grid_plan.grid_plans(False):
            b = fast(images, lm)
        assert joint.calls == {"labels_on_grids": 0}
        c = fast(images, lm)  # the plan the first forward kept
    assert joint.calls == {"labels_on_grids": 1}
    assert_close(b.target, a.target, rtol=1e-6, atol=1e-6)
    assert_close(c.target, a.target, rtol=1e-6, atol=1e-6)


def test_a_plan_is_current_in_its_own_thread_alone() -> None:
    """``nn.DataParallel`` runs its replicas' forwards in threads of one process: one thread's plan is not another's
    (a ``Kernels`` made on the CPU's route while another thread plans must build grid by grid, for its bits), and a
    thread's plan is gone when its forward ends."""
    import threading

    owner = torch.nn.Identity()
    images = torch.zeros(1, 3, 8, 8)
    seen: list[object] = []
    with launch_routes(), _grid_plan.planning(owner, images) as plan:
        assert plan is not None and _grid_plan.current_plan() is plan
        other = threading.Thread(target=lambda: seen.append(_grid_plan.current_plan()))
        other.start()
        other.join()
    assert seen == [None]
    assert _grid_plan.current_plan() is None
    assert vars(owner)["_grid_plans"] == {(8, 8): {}}
    with _grid_plan.planning(owner, images) as off:  # the CPU's eager route: none
        assert off is None and _grid_plan.current_plan() is None
