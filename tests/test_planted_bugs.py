"""Planted bugs of the three kinds a family can get wrong each fail the fast-versus-reference check.

Issue 30 kept a second, independent walk per family (the reference path: explicit float64
matrices on ``DenseRules``, a different API from the fast path's events), because the
comparison of the two catches what neither path could see alone. This file holds that claim:
each test plants one bug (by monkeypatching one function for the test's duration) and shows
that ``check_parity`` (fast = reference, ``tests/test_backbones_common.py``) no longer passes.
``docs/adding-a-family.md`` lists what each check can and cannot catch.

- a missed residual event: the fast path forgets to report one aligned layer's label mix;
- a wrong conv matrix: a conv's label kernel transposed (on either path), or taken without abs;
- a skipped aggregate: a downsampling step (patch merging, a strided conv) not applied to the labels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_backbones_common import check_parity
from torch import Tensor, nn

from mixlabels import backbones
from mixlabels._trackers import CompactTracker
from mixlabels.backbones import _convnet, _dense

EXAMPLES = {f.name: f.example for f in backbones.FAMILIES}
CAUGHT = (AssertionError, RuntimeError, ValueError)  # a wrong value, or a shape that no longer fits


def _model(family: str) -> nn.Module:
    """The family's example, its attention sharpened: at init it is nearly uniform, and a check on targets
    that alignment hardly moves could hardly fail (``check_parity`` asserts that they move)."""
    model = EXAMPLES[family]()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("qkv.weight"):
                p.mul_(6.0)
    return model


@pytest.mark.parametrize("family", ["vit", "swin", "resnet", "convnext"])
def test_the_unplanted_check_passes(family: str) -> None:
    check_parity(_model(family), "tl_align")  # the control: the plants below are what makes it fail


@pytest.mark.parametrize("family", ["vit", "swin", "resnet", "convnext"])
def test_a_missed_residual_event_fails(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    original = CompactTracker.residual

    def forgets_the_second_mix(self: CompactTracker, layer: int, keep: Tensor | None, *, mixed: Tensor | None) -> None:
        if mixed is not None:
            seen.append(layer)
            if len(seen) == 2:
                return  # the event a refactor could drop: one aligned layer's labels never move
        original(self, layer, keep, mixed=mixed)

    monkeypatch.setattr(CompactTracker, "residual", forgets_the_second_mix)
    with pytest.raises(AssertionError):
        check_parity(_model(family), "tl_align")
    assert len(seen) >= 2, "the plant never fired: the test would pass for the wrong reason"


def _transposed(fn: Callable[..., Any], arg: int) -> Callable[..., Any]:
    def wrong(*args: Any, **kwargs: Any) -> Any:
        args_l = list(args)
        args_l[arg] = args_l[arg].transpose(-2, -1).contiguous()
        return fn(*args_l, **kwargs)

    return wrong


@pytest.mark.parametrize("family", ["resnet", "convnext"])
def test_a_transposed_conv_kernel_on_the_fast_path_fails(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the fast path's label kernels: both families compute a forward's kernels together (_convnet.Kernels)
    original = _convnet.label_kernels
    monkeypatch.setattr(_convnet, "label_kernels", lambda ws: [k.T.contiguous() for k in original(ws)])
    with pytest.raises(AssertionError):
        check_parity(_model(family), "tl_align")


def test_a_transposed_conv_matrix_on_the_reference_path_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_convnet, "conv_matrix", _transposed(_dense.conv_matrix, 1))
    with pytest.raises(AssertionError):
        check_parity(_model("resnet"), "tl_align")


def test_a_kernel_without_abs_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def signed(weight: Tensor) -> Tensor:  # the bug a reviewer found once: |K| forgotten
        k = weight.detach().float()
        return (k / k.sum(dim=(-2, -1), keepdim=True)).mean(dim=(0, 1))

    monkeypatch.setattr(_convnet, "label_kernels", lambda ws: [signed(w) for w in ws])
    with pytest.raises(AssertionError):
        check_parity(_model("resnet"), "tl_align")


@pytest.mark.parametrize("family", ["swin", "resnet", "pvt_v2"])
def test_a_skipped_aggregate_fails(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = CompactTracker.aggregate

    def skips_the_first(self: CompactTracker, merge: Callable[[Tensor], Tensor], *, normalised: bool = False, linear: bool = False) -> None:
        calls.append(1)
        if len(calls) == 1:
            return  # the labels stay on the finer grid while the tokens moved to the coarser one
        original(self, merge, normalised=normalised, linear=linear)

    monkeypatch.setattr(CompactTracker, "aggregate", skips_the_first)
    with pytest.raises(CAUGHT):
        check_parity(_model(family), "tl_align")
    assert calls, "the plant never fired: the family emits no aggregate"


def test_a_wrong_aggregate_that_keeps_shapes_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quieter kind: the merge runs but averages the wrong windows (same shapes, wrong values)."""
    original = CompactTracker.aggregate

    def rolled(self: CompactTracker, merge: Callable[[Tensor], Tensor], *, normalised: bool = False, linear: bool = False) -> None:
        original(self, lambda y: merge(torch.roll(y, shifts=1, dims=1)), normalised=normalised, linear=linear)

    monkeypatch.setattr(CompactTracker, "aggregate", rolled)
    with pytest.raises(AssertionError):
        check_parity(_model("swin"), "tl_align")
