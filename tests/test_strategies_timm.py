"""Parity with timm: same lambda and box -> same pixels and the same soft targets.

timm draws with numpy's global RNG; we force its draws to ours (patching its
``_params_per_*`` and box functions) and compare outputs, and separately check our
box formula against ``rand_bbox`` under a seeded numpy.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest
import timm.data.mixup as timm_mixup
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

from mixlabels.strategies import BoxParams, CutMix, MixUp, cutmix_boxes
from mixlabels.strategies._cutmix import minmax_boxes

NC = 300  # > 256: class ids must survive everything exactly


def batch(b: int, hh: int = 12, ww: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, 3, hh, ww, generator=g), torch.randint(0, NC, (b,), generator=g)


@given(st.floats(0.0, 1.0), st.integers(1, 40), st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_box_formula_equals_timm_rand_bbox(lam: float, hh: int, ww: int, seed: int) -> None:
    np.random.seed(seed)
    expected = timm_mixup.rand_bbox((hh, ww), lam)
    np.random.seed(seed)  # replay the two centre draws rand_bbox made
    cy, cx = np.random.randint(0, hh), np.random.randint(0, ww)
    got = cutmix_boxes(torch.tensor([lam], dtype=torch.float64), torch.tensor([cy]), torch.tensor([cx]), (hh, ww))
    assert got[0].tolist() == [int(v) for v in expected]


def _boxes_iter(boxes: torch.Tensor, lam: torch.Tensor) -> Iterator[tuple[int, ...]]:
    for box, lm in zip(boxes.tolist(), lam.tolist()):
        if lm != 1.0:  # timm skips samples whose lambda is 1
            yield tuple(box)


def _force_timm(monkeypatch: pytest.MonkeyPatch, mix: Any, mode: str, lam: torch.Tensor, cut: bool, boxes: torch.Tensor | None) -> None:
    b = lam.shape[0]
    if mode == "batch":
        monkeypatch.setattr(mix, "_params_per_batch", lambda: (float(lam[0]), cut))
    else:
        n = b if mode == "elem" else b // 2
        monkeypatch.setattr(mix, "_params_per_elem", lambda size: (lam[:n].numpy().astype(np.float32), np.full(n, cut)))
    if boxes is not None:
        n = 1 if mode == "batch" else (b if mode == "elem" else b // 2)
        it = _boxes_iter(boxes[:n], lam[:n])
        fake = lambda *a, **k: next(it)  # noqa: E731
        monkeypatch.setattr(timm_mixup, "rand_bbox", fake)
        monkeypatch.setattr(timm_mixup, "rand_bbox_minmax", fake)


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_mixup_pixels_and_targets_equal_timm(monkeypatch: pytest.MonkeyPatch, mode: str, smoothing: float) -> None:
    x, y = batch(6)
    mixer = MixUp(NC, alpha=0.8, label_smoothing=smoothing, mode=mode)  # type: ignore[arg-type]
    p = mixer.sample(x.shape, generator=torch.Generator().manual_seed(3))
    mixed, lm = mixer.mix(x, y, p)
    ref = timm_mixup.Mixup(mixup_alpha=0.8, cutmix_alpha=0.0, label_smoothing=smoothing, num_classes=NC, mode=mode)
    _force_timm(monkeypatch, ref, mode, p.lam, False, None)
    ref_x, ref_t = ref(x.clone(), y)
    assert torch.equal(mixed, ref_x)  # bit-exact pixels
    assert_close(lm.targets(lm.image_weights), ref_t)


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
# (False, minmax): timm corrects lambda whenever minmax is set, whatever correct_lam says
@pytest.mark.parametrize(("correct_lam", "minmax"), [(True, None), (False, None), (True, (0.2, 0.8)), (False, (0.2, 0.8))])
def test_cutmix_pixels_and_targets_equal_timm(
    monkeypatch: pytest.MonkeyPatch, mode: str, correct_lam: bool, minmax: tuple[float, float] | None
) -> None:
    x, y = batch(8, 16, 20, seed=1)
    mixer = CutMix(NC, alpha=1.0, minmax=minmax, correct_lam=correct_lam, label_smoothing=0.1, mode=mode)  # type: ignore[arg-type]
    p = mixer.sample(x.shape, generator=torch.Generator().manual_seed(5))
    mixed, lm = mixer.mix(x, y, p)
    ref = timm_mixup.Mixup(
        mixup_alpha=0.0, cutmix_alpha=1.0, cutmix_minmax=minmax, correct_lam=correct_lam,
        label_smoothing=0.1, num_classes=NC, mode=mode,
    )
    _force_timm(monkeypatch, ref, mode, p.lam, True, p.boxes)
    ref_x, ref_t = ref(x.clone(), y)
    assert torch.equal(mixed, ref_x)
    assert_close(lm.targets(lm.image_weights), ref_t)
    if correct_lam or minmax is not None:  # the label weight is then the true pasted area
        assert_close(lm.image_weights[:, 0], lm.mask[:, 0].mean((1, 2)))


def test_cutmix_clipping_corrects_lambda_like_timm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A box centred on a corner is clipped; the label follows the clipped area, as timm's correct_lam."""
    box = cutmix_boxes(torch.tensor([0.5, 0.5]), torch.tensor([0, 0]), torch.tensor([0, 0]), (10, 10))
    assert box[0].tolist() == [0, 4, 0, 4]  # side int(10 * sqrt(.5)) = 7: [0 - 3, 0 + 4) clipped to [0, 4)
    monkeypatch.setattr(timm_mixup, "rand_bbox", lambda *a, **k: (0, 4, 0, 4))
    _, timm_lam = timm_mixup.cutmix_bbox_and_lam((10, 10), 0.5, correct_lam=True)
    params = BoxParams(
        partner=torch.tensor([1, 0]), applied=torch.tensor([True, True]), image_size=(10, 10),
        boxes=box, lam=torch.tensor([0.5, 0.5]), grid=(10, 10), correct_lam=True,
    )
    _, lm = CutMix(NC).mix(torch.rand(2, 1, 10, 10), torch.tensor([1, 2]), params)
    assert_close(lm.image_weights[:, 0], torch.full((2,), float(timm_lam)))


@given(st.integers(4, 40), st.integers(4, 40), st.integers(0, 2**31 - 1))
def test_minmax_boxes_follow_timm_bounds(hh: int, ww: int, seed: int) -> None:
    mm = (0.2, 0.8)
    boxes = minmax_boxes(mm, (hh, ww), 64, torch.Generator().manual_seed(seed), torch.device("cpu"))
    sides_h, sides_w = boxes[:, 1] - boxes[:, 0], boxes[:, 3] - boxes[:, 2]
    assert ((sides_h >= int(hh * mm[0])) & (sides_h < max(int(hh * mm[1]), int(hh * mm[0]) + 1))).all()
    assert ((sides_w >= int(ww * mm[0])) & (sides_w < max(int(ww * mm[1]), int(ww * mm[0]) + 1))).all()
    assert (boxes[:, 0] >= 0).all() and (boxes[:, 1] <= hh).all() and (boxes[:, 2] >= 0).all() and (boxes[:, 3] <= ww).all()
