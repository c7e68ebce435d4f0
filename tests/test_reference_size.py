"""The dense reference path refuses, before allocating, what would exhaust memory (issue 29, item 17).

``AdaptedBase.forward`` checks ``adapter.reference_bytes(label_map)`` (an ``(n, n)`` float64 matrix per
sample on the grid the reference's labels start on, and the ``(b, n, c)`` labels) against
``REFERENCE_LIMIT`` before the reference runs. The estimate is only as good as that grid: every
family's ``reference_grid`` is held to the grid its reference actually starts on.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import timm
import torch

from mixlabels import TLAlign, TokenLabelMap, _trackers
from mixlabels.backbones import FAMILIES, adapt
from mixlabels.backbones import _common
from tests.test_backbones_common import cutmix_batch

ALIGNING = [f for f in FAMILIES if f.name != "any"]


def _start_grids(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record the grid of every dense tracker the reference starts (where its labels begin)."""
    seen: list[tuple[int, int]] = []
    init = _trackers.DenseTracker.__init__

    def record(self: Any, rules: Any, label_map: Any, layout: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(tuple(layout.grid))
        init(self, rules, label_map, layout, *args, **kwargs)

    monkeypatch.setattr(_trackers.DenseTracker, "__init__", record)
    return seen


@pytest.mark.parametrize("family", ALIGNING, ids=[f.name for f in ALIGNING])
def test_reference_grid_is_where_the_reference_starts(monkeypatch: pytest.MonkeyPatch, family: Any) -> None:
    seen = _start_grids(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for token_space in (False, True):
            images, lm = cutmix_batch(token_space=token_space)
            adapted = adapt(family.example(), TLAlign(), reference=True)
            seen.clear()
            try:
                adapted(images, lm)
            except ValueError as e:  # a family that cannot mix tokens (CrossViT's two grids) refuses MixToken
                assert token_space, e
                continue
            (gh, gw), (sh, sw) = adapted.reference_grid(lm), seen[0]
            if token_space:  # the pixel-start families begin on their stem grid here: the estimate may only be larger
                assert gh * gw >= sh * sw
            else:
                assert (gh, gw) == (sh, sw)
        # and the check comes first: with no room at all, nothing of the reference runs
        monkeypatch.setattr(_common, "REFERENCE_LIMIT", 0)
        seen.clear()
        images, lm = cutmix_batch()
        with pytest.raises(ValueError, match=r"use the fast path \(reference=False\), or the reference on smaller images"):
            adapted(images, lm)
        assert seen == []


def _default_size(name: str, size: int) -> tuple[Any, torch.Tensor, TokenLabelMap]:
    """A timm model at its default size on the meta device (nothing allocated), with a batch of 2."""
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False)
    lm = TokenLabelMap.unmixed(torch.tensor([0, 1]), 1000, (size, size)).to("meta")
    return model, torch.empty(2, 3, size, size, device="meta"), lm


@pytest.mark.parametrize(
    ("name", "size", "gib"),
    [("resnet18", 224, 38.3), ("efficientnet_b0", 224, 38.3), ("mobilevit_xxs", 256, 65.0), ("crossvit_tiny_240", 240, 50.3),
     ("volo_d1_224", 224, 38.3), ("coatnet_0_rw_224", 224, 4.7)],
)
def test_reference_at_default_size_is_refused_with_the_estimate(name: str, size: int, gib: float) -> None:
    model, images, lm = _default_size(name, size)
    with pytest.raises(ValueError, match=rf"would build {gib} GiB float64 matrices for 2 {size}x{size} images.*use the fast path"):
        adapt(model, TLAlign(), reference=True)(images, lm)


def test_reference_of_a_vit_at_default_size_is_allowed() -> None:
    model, _, lm = _default_size("vit_base_patch16_224", 224)
    adapted = adapt(model, TLAlign(), reference=True)
    assert adapted.reference_grid(lm) == (14, 14)
    _common.check_reference_size(adapted, lm)  # 196 tokens: a few MB
