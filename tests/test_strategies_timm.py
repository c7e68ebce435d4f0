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

from mixlabels.strategies import (
    BoxParams,
    CutMix,
    ElemSwitch,
    ElemSwitchParams,
    MixUp,
    MixUpParams,
    Switch,
    SwitchParams,
    cutmix_boxes,
)
from mixlabels.strategies import timm_mixup as mixup_from_timm_args
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
        assert_close(lm.image_weights[:, 0], lm.mask.dense()[:, 0].mean((1, 2)))


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



# ---------------------------------------------------------------------------- timm_mixup: every argument
def _timm_draws(p: Any, b: int, mode: str) -> tuple[np.ndarray, np.ndarray, list[tuple[int, ...]]]:
    """Our params as timm's per-sample ``(lam, use_cutmix)`` and the boxes its rand_bbox calls must return."""
    if isinstance(p, SwitchParams):
        cut = np.full(b, p.choice == 1)
        lam, boxes = p.params.lam, getattr(p.params, "boxes", None)
    elif isinstance(p, ElemSwitchParams):
        cut = p.cut.numpy()
        lam, boxes = torch.where(p.cut, p.cutmix.lam, p.mixup.lam), p.cutmix.boxes
    elif isinstance(p, MixUpParams):
        cut, lam, boxes = np.zeros(b, dtype=bool), p.lam, None
    else:
        cut, lam, boxes = np.ones(b, dtype=bool), p.lam, p.boxes
    n = 1 if mode == "batch" else (b if mode == "elem" else b // 2)
    lam_np = lam.numpy().astype(np.float32)[:n]
    used = [tuple(boxes[i].tolist()) for i in range(n) if cut[i] and lam_np[i] != 1.0] if boxes is not None else []
    return lam_np, cut[:n], used


def _force(monkeypatch: pytest.MonkeyPatch, ref: Any, p: Any, b: int, mode: str) -> None:
    """Make timm's Mixup (or FastCollateMixup) draw what our params drew."""
    lam, cut, boxes = _timm_draws(p, b, mode)
    if mode == "batch":
        monkeypatch.setattr(ref, "_params_per_batch", lambda: (float(lam[0]), bool(cut[0])))
    else:
        monkeypatch.setattr(ref, "_params_per_elem", lambda size: (lam.copy(), cut.copy()))
    it = iter(boxes)
    fake = lambda *a, **k: next(it)  # noqa: E731
    monkeypatch.setattr(timm_mixup, "rand_bbox", fake)
    monkeypatch.setattr(timm_mixup, "rand_bbox_minmax", fake)


TIMM_ARGS: list[tuple[dict[str, Any], type]] = [
    ({}, MixUp),  # timm's defaults: MixUp alpha 1, smoothing 0.1
    ({"mixup_alpha": 0.0, "cutmix_alpha": 1.0}, CutMix),
    ({"mixup_alpha": 0.8, "cutmix_alpha": 1.0}, Switch),
    ({"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "switch_prob": 1.0}, Switch),
    ({"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "mode": "pair"}, ElemSwitch),
    ({"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "mode": "elem", "prob": 0.6}, ElemSwitch),
    ({"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "mode": "elem", "switch_prob": 0.3, "correct_lam": False}, ElemSwitch),
    ({"cutmix_minmax": (0.2, 0.8)}, Switch),  # minmax activates CutMix beside the default MixUp
    ({"mixup_alpha": 0.0, "cutmix_minmax": (0.3, 0.9), "mode": "elem"}, CutMix),
    ({"mixup_alpha": 0.0, "cutmix_alpha": 0.5, "correct_lam": False, "mode": "pair", "label_smoothing": 0.0}, CutMix),
    ({"mixup_alpha": 2.0, "mode": "pair", "prob": 0.5, "label_smoothing": 0.2}, MixUp),
]


@pytest.mark.parametrize(("args", "kind"), TIMM_ARGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_timm_mixup_arguments_give_timm_s_pixels_and_targets(
    monkeypatch: pytest.MonkeyPatch, args: dict[str, Any], kind: type, seed: int
) -> None:
    x, y = batch(8, 16, 20, seed=seed)
    ours = mixup_from_timm_args(**args, num_classes=NC)
    assert type(ours) is kind
    p = ours.sample(x.shape, generator=torch.Generator().manual_seed(seed))
    mixed, lm = ours.mix(x, y, p)
    ref = timm_mixup.Mixup(**args, num_classes=NC)
    _force(monkeypatch, ref, p, 8, args.get("mode", "batch"))
    ref_x, ref_t = ref(x.clone(), y)
    assert torch.equal(mixed, ref_x)
    assert_close(lm.image_targets(), ref_t)
    lm.check()


@pytest.mark.parametrize(("args", "kind"), TIMM_ARGS[:6])
def test_mixup_enabled_off_passes_the_batch_through_as_timm(args: dict[str, Any], kind: type) -> None:
    x, y = batch(6)
    ours = mixup_from_timm_args(**args, num_classes=NC)
    ours.mixup_enabled = False
    ref = timm_mixup.Mixup(**args, num_classes=NC)
    ref.mixup_enabled = False
    out, lm = ours(x, y)
    ref_x, ref_t = ref(x.clone(), y)
    assert torch.equal(out, x) and torch.equal(ref_x, x)
    assert lm.num_sources == 1
    assert_close(lm.image_targets(), ref_t)
    ours.mixup_enabled = True
    out, lm = ours(x, y, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(out, x)  # switched back on, it mixes again


def test_elem_switch_mixes_both_kinds_in_one_batch() -> None:
    x, y = batch(32, 16, 16)
    mixer = ElemSwitch(NC, mixup_alpha=0.8, cutmix_alpha=1.0, mode="elem")
    p = mixer.sample(x.shape, generator=torch.Generator().manual_seed(0))
    assert p.cut.any() and (~p.cut).any()
    mixed, lm = mixer.mix(x, y, p)
    blended = ~p.cut & p.applied
    assert_close(lm.mask.dense()[blended, 0], p.mixup.lam[blended].view(-1, 1, 1).expand(-1, 16, 16))
    assert set(lm.mask.dense()[p.cut, 0].unique().tolist()) <= {0.0, 1.0}  # boxes stay binary
    many = ElemSwitch(NC, switch_prob=0.3, mode="elem").sample((4000, 1, 4, 4), generator=torch.Generator().manual_seed(1))
    assert abs(many.cut.float().mean().item() - 0.3) < 0.03  # timm's law: switch_prob is the chance of a box
    assert Switch.__name__ == type(mixup_from_timm_args(cutmix_alpha=1.0, switch_prob=0.3)).__name__
    assert mixup_from_timm_args(cutmix_alpha=1.0, switch_prob=0.3).probs == pytest.approx((0.7, 0.3))  # type: ignore[attr-defined]
    assert_close(lm.image_weights[:, 0], lm.mask.dense()[:, 0].mean((1, 2)))  # correct_lam: label = pixels


def test_timm_mixup_refusals() -> None:
    with pytest.raises(ValueError, match="no mixing is active"):
        mixup_from_timm_args(mixup_alpha=0.0)
    with pytest.raises(ValueError, match="half"):
        mixup_from_timm_args(mode="half")
    with pytest.raises(ValueError, match="multi_label"):
        mixup_from_timm_args(multi_label=True)
    with pytest.raises(ValueError, match="'elem' or 'pair'"):
        ElemSwitch(NC, mode="batch")


def test_mixup_enabled_off_inside_kornia_sequential() -> None:
    import kornia.augmentation as K

    from mixlabels.strategies import sequential_label_map

    x, y = batch(4)
    mixer = mixup_from_timm_args(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=NC)
    seq = K.AugmentationSequential(mixer, data_keys=["input"])
    mixer.mixup_enabled = False
    assert torch.equal(seq(x), x)
    lm = sequential_label_map(seq, y)
    assert lm.num_sources == 1 and lm.image_size == (12, 16)
    mixer.mixup_enabled = True
    assert not torch.equal(seq(x), x)
    assert sequential_label_map(seq, y).num_sources == 2
