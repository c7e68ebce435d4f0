"""Every family's fast path equals its reference on every label route, not only the one its tiny example takes.

The examples run at 32 px, so their label convs take the small-grid route (tap matrices, ``_DENSE_CONV_TOKENS``)
and their windows the pooled one (``window_route``). Real models at 224 px run their first stages' label convs
as depthwise convolutions (kernels expanded and in-grid tap weights computed together per forward:
``Kernels.wide``, ``Kernels.mass``) and, on a CPU at large batches, their windows as matrices. Here each family's
fast path and reference (explicit float64 matrices; ``tests/test_backbones_common``) run with every grid taken as
large: depthwise label convs everywhere, windows by matrices (dense or separable by size). Each runs on its own
copy of the model, since a training forward moves the batch norms' running statistics that RepVGG-style kernels
fold in.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_backbones_common import _fast_and_reference
from torch import Tensor

from mixlabels import backbones
from mixlabels.backbones import _common, _convnet, _windows

FAMILIES = {f.name: f for f in backbones.FAMILIES if f.name != "any"}  # "any": no label rules of its own


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parity_with_depthwise_label_convs_and_matrix_windows(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_common, "_DENSE_CONV_TOKENS", 0)  # every grid "large": depthwise label convs
    monkeypatch.setattr(_windows, "_POOLED_CPU_POSITIONS", 0)  # windows by the matrix routes
    model = FAMILIES[family].example()
    _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), "tl_align")  # targets and logits to 1e-5


@pytest.mark.parametrize("family", ["resnet", "ghostnet", "densenet"])
def test_a_tap_weight_computed_together_without_its_border_fails(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control of the test above for the tap weights ``Kernels.mass`` computes for many convs at once: taken as
    1 everywhere (the border's missing taps forgotten), the fast path no longer equals the reference."""
    monkeypatch.setattr(_common, "_DENSE_CONV_TOKENS", 0)
    original = _convnet.Kernels.mass
    fired: list[int] = []

    def borderless(self: _convnet.Kernels, conv: Any, grid: tuple[int, int]) -> Tensor | None:
        mass = original(self, conv, grid)
        if mass is None:
            return None
        fired.append(1)
        return torch.ones_like(mass)

    monkeypatch.setattr(_convnet.Kernels, "mass", borderless)
    model = FAMILIES[family].example()
    with pytest.raises(AssertionError):
        _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), "tl_align")
    assert fired, "the plant never fired: no tap weights were computed together"
