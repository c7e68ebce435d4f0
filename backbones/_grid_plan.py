"""Which grids a forward's label convs asked for, kept for the next forward of the same input size (``GridPlan``).

On a GPU's eager route every operator is a kernel launch, and a CNN's label convs build, per kernel group and grid,
their in-grid tap weights (a convolution of ones) or their small-grid matrices (a product and a division). One
forward learns which grids each group is asked for; the next forward of that input size builds each group on all of
them in one call (``Kernels`` in ``backbones._convnet``). A plan only says what to build together: every tensor is
still computed from this forward's own kernels, so a stale or foreign plan costs a few small tensors nobody reads,
never a wrong label. Compiled graphs and the CPU's eager route keep none (``eager_launch_routes``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor

from mixlabels._routes import eager_launch_routes, switched

__all__ = ["Grid", "GridPlan", "PlanKey", "current_plan", "grid_plans", "planning"]

Grid = tuple[int, int]
PlanKey = tuple[str, tuple[Any, ...]]
"""What is built (``"mass"`` or ``"matrix"``) and for whom: a ``Kernels``' place in its forward and its group's key."""

_PLANNED = [True]
"""Whether a GPU's eager walk builds a group's tap weights and matrices on every grid its last forward asked for at
once (``grid_plans``)."""


class _Current(threading.local):
    plan: GridPlan | None = None


_CURRENT = _Current()
"""The running forward's plan (``planning``), which the ``Kernels`` it makes read (``current_plan``); per thread, as
``nn.DataParallel`` runs its replicas' forwards in threads of one process."""

_GRID_PLANS = 8
"""Input sizes whose plan an adapter keeps (the oldest dropped first): a multi-scale loader's few sizes, not one per
batch of a dynamic-size run."""


def grid_plans(on: bool) -> AbstractContextManager[None]:
    """Inside, a GPU's eager walk builds each label-conv group's in-grid tap weights and matrices on all the grids the
    last forward of its input size asked for at once (``on``, the default: ``GridPlan``), or grid by grid as they are
    asked (the CPU's route, the tested fallback): ``benchmarks/gpu_suite.py --family-mode eager --family-routes
    plans=off`` times both on a GPU."""
    return switched(_PLANNED, on)


class GridPlan:
    """The grids a forward asked ``Kernels`` for each group's tap weights (``"mass"``) and matrices (``"matrix"``) on,
    in order, and the last forward's, which this one builds from: a group's first ask on a grid the last forward
    asked for too builds that group on every grid the last forward asked for (the masses of all its large grids and
    its matrices on all its small grids) by one product and one division (``labels_on_grids``), where each grid took
    its own call and a group's masses and matrices one each. A forward that asks for another grid builds that one
    alone; one that asks for fewer builds a few small tensors it does not read."""

    def __init__(self, last: Mapping[PlanKey, tuple[Grid, ...]] | None = None) -> None:
        self.last = dict(last or {})
        self.asked: dict[PlanKey, dict[Grid, None]] = {}
        self._scopes = 0

    def scope(self) -> int:
        """A place for the next ``Kernels`` of this forward (the forward's ``Kernels`` in the order they are made, the
        same in every forward of one walk), so that two of them with alike groups keep apart plans."""
        self._scopes += 1
        return self._scopes

    def ask(self, what: str, key: tuple[Any, ...], grid: Grid) -> None:
        self.asked.setdefault((what, key), {})[grid] = None

    def planned(self, what: str, key: tuple[Any, ...], grid: Grid) -> tuple[Grid, ...]:
        """The grids to build ``key``'s ``what`` on at its ask on ``grid``: the last forward's, where they hold it."""
        grids = self.last.get((what, key), ())
        return grids if grid in grids else (grid,)

    def next(self) -> dict[PlanKey, tuple[Grid, ...]]:
        """This forward's asks: the next forward's plan."""
        return {k: tuple(v) for k, v in self.asked.items()}


def current_plan() -> GridPlan | None:
    """The plan of the forward running now (``planning``); ``None`` outside one, compiled, or on the CPU's route."""
    if torch.compiler.is_compiling():  # a trace reads no thread-local state (and a compiled graph keeps no plan)
        return None
    return _CURRENT.plan


def planning(owner: torch.nn.Module, images: Tensor) -> AbstractContextManager[GridPlan | None]:
    """Around an adapter's aligned forward: a ``GridPlan`` from ``owner``'s last forward of ``images``' size, current
    inside (``current_plan``), kept as the next one's when the forward finishes (a forward that raised keeps the last
    plan). A null context (no plan read or kept) off the GPU's eager route (compiled graphs: nothing of this is
    traced) or under ``grid_plans(False)``."""
    if not eager_launch_routes(images.device) or not _PLANNED[0]:
        return nullcontext()
    return _planning(owner, (int(images.shape[-2]), int(images.shape[-1])))


@contextmanager
def _planning(owner: torch.nn.Module, size: Grid) -> Iterator[GridPlan]:
    plans: dict[Grid, dict[PlanKey, tuple[Grid, ...]]] = vars(owner).setdefault("_grid_plans", {})
    plan, outer = GridPlan(plans.get(size)), _CURRENT.plan
    _CURRENT.plan = plan
    try:
        yield plan
    finally:
        _CURRENT.plan = outer
    plans.pop(size, None)  # re-inserted last: the most recent size is the last dropped
    plans[size] = plan.next()
    while len(plans) > _GRID_PLANS:
        plans.pop(next(iter(plans)))
