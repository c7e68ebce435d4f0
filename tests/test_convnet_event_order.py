"""When ``AdaptedConvNet`` runs a unit's label events: right after the unit's forward, unless a label kernel reads
batch norms' running statistics.

A training step's memory peaks when the forward has saved every activation. Label events run after the whole forward
add their temporaries on top of that peak: for labels on a pixel grid (CSPNet's stride-1 stem at 256 px) that is
megabytes, and CSPDarkNet-17's CPU step allocated 1.7% more than NoAlign's. Events run unit by unit come and go
before the peak. Only a ``KernelConv`` that folds batch norms (RepViT's reparameterised blocks) needs the whole
forward first: a training forward moves those statistics, and its label kernel must read them after its own block,
as the reference does.

Units without a shortcut (SelecSLS, DenseNet) aggregate, and a run of them is one aggregate: that run ends where the
grid shrinks, or SelecSLS, all of whose units are such, walked its labels after its whole forward (1.6% over NoAlign's
peak).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from test_backbones_common import WrappedScheme, cutmix_batch
from torch import Tensor, nn

from mixlabels import TLAlign, backbones
from mixlabels._align import Fork, LabelTracker
from mixlabels.backbones._convnet import AdaptedConvNet, CrossPart, _reads_statistics

FAMILIES = {f.name: f for f in backbones.FAMILIES}


class _Logged:
    """A tracker that logs every event it receives in ``order``, then delegates."""

    def __init__(self, tracker: LabelTracker, order: list[str]) -> None:
        self._t, self._order = tracker, order

    def residual(self, layer: int, keep: Tensor | None, *, mixed: Tensor | None) -> None:
        self._order.append("label")
        self._t.residual(layer, keep, mixed=mixed)

    def aggregate(self, merge: Callable[[Tensor], Tensor], *, normalised: bool = False) -> None:
        self._order.append("label")
        self._t.aggregate(merge, normalised=normalised)

    def fork(self) -> Fork:
        self._order.append("label")
        return self._t.fork()

    def join(
        self, fork: Fork, share: float, *, merge: Callable[[Tensor], Tensor] | None = None, keep: Tensor | None = None,
        normalised: bool = False,
    ) -> None:
        self._order.append("label")
        self._t.join(fork, share, merge=merge, keep=keep, normalised=normalised)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


def _modules(units: Any) -> Iterator[nn.Module]:
    for unit in units:
        if isinstance(unit, CrossPart):
            yield from _modules(unit.units)
        else:
            yield unit


def _order(name: str) -> tuple[list[str], AdaptedConvNet]:
    """What one TL-Align training forward of the family's example did, in order, from its first block conv to its last:
    ``conv`` (a conv inside a unit ran) and ``label`` (the tracker received an event)."""
    order: list[str] = []
    adapted = backbones.adapt(FAMILIES[name].example().train(), WrappedScheme(TLAlign(), lambda t: _Logged(t, order)))
    assert isinstance(adapted, AdaptedConvNet)
    convs = {m for unit in _modules(adapted._blocks()) for m in unit.modules() if isinstance(m, nn.Conv2d)}
    hooks = [c.register_forward_hook(lambda *_: order.append("conv")) for c in convs]
    try:
        images, lm = cutmix_batch()
        torch.manual_seed(0)
        adapted(images, lm).loss().backward()
    finally:
        for h in hooks:
            h.remove()
    first, last = order.index("conv"), len(order) - 1 - order[::-1].index("conv")
    return order[first : last + 1], adapted


# SelecSLS and DenseNet: units without shortcut, whose run is one aggregate (``_Pending``) ending where the grid shrinks
@pytest.mark.parametrize("name", ["cspnet", "vovnet", "fasternet", "inception_next", "selecsls", "densenet"])
def test_events_follow_each_unit_when_no_kernel_reads_statistics(name: str) -> None:
    order, adapted = _order(name)
    paths = adapted._all_paths(adapted._blocks())
    assert not _reads_statistics(paths)
    assert "label" in order, f"{name}: every label event waited for the whole forward, on top of its saved activations"


def test_a_kernel_folding_batch_norms_waits_for_the_whole_forward() -> None:
    order, adapted = _order("repvit")
    assert _reads_statistics(adapted._all_paths(adapted._blocks()))
    assert "label" not in order, "repvit: a label event ran between block forwards; its folded kernels read stale statistics"
