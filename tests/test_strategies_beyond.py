"""The mixers beyond the papers (FMix, ResizeMix, SaliencyMix, GridMix, TokenMix): kornia's test
template (smoke, exception, cardinality, feature, gradcheck, dynamo, AugmentationSequential) and
property tests against the pixels (the mask read back from the mixed images).

Images are non-square (16 x 12) so a swapped height and width shows; cells are 4 px.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable
from unittest import mock

import hypothesis.strategies as st
import kornia.augmentation as K
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from kornia.augmentation import AugmentationSequential
from pydantic import TypeAdapter
from torch import Tensor
from torch.testing import assert_close

import mixlabels.strategies._fmix as fmix_module
import mixlabels.strategies._gridmix as grid_module
from mixlabels.strategies._host_draws import draw_beta, draw_pairs, host_rng, to_fp32
from mixlabels import TokenLabelMap
from mixlabels import BoxMask
from mixlabels.strategies import (
    BlockwiseMix,
    CellParams,
    FMix,
    GridMix,
    Mixer,
    MixerConfig,
    ResizeMix,
    ResizeParams,
    SaliencyMix,
    SaliencyParams,
    Switch,
    SwitchParams,
    TokenMix,
    sequential_label_map,
)
from mixlabels.strategies._base import pair_label_map, select_images
from mixlabels.strategies._cutmix import box_inside
from mixlabels.strategies._paste import paste_boxes, paste_cells, shared_cells
from mixlabels.strategies._resizemix import resize_index, resize_indices
from mixlabels.strategies._saliencymix import saliency_peaks, spectral_residual_saliency
from test_strategies_kornia import CELL, NC, H, W, batch, maps_equal
from test_strategies_kornia import KINDS as PAPER_KINDS
from test_strategies_kornia import make as make_paper

KINDS = ("fmix", "fmix_cell", "resizemix", "resizemix_patch", "saliencymix", "saliencymix_patch", "gridmix", "tokenmix", "switch")
PAIR_KINDS = [k for k in KINDS if k != "switch"]
MODES = ("batch", "pair", "elem")
PAIRINGS = ("flip", "derangement")
MASK_GRID = {
    "fmix": (H, W),
    "fmix_cell": (H // CELL, W // CELL),
    "resizemix": (H, W),
    "resizemix_patch": (H // CELL, W // CELL),
    "saliencymix": (H, W),
    "saliencymix_patch": (H // CELL, W // CELL),
    "gridmix": (H // 2, W // 2),  # cell sizes 2 and 4: the common grid has 2 px cells
    "tokenmix": (H // CELL, W // CELL),
}
BOX_KINDS = ("resizemix", "resizemix_patch", "saliencymix", "saliencymix_patch")
modes = st.sampled_from(MODES)
pairings = st.sampled_from(PAIRINGS)
seeds = st.integers(0, 2**31 - 1)


def make(
    kind: str,
    *,
    mode: str = "batch",
    pairing: str = "flip",
    prob: float = 1.0,
    seed: int | None = None,
    label_smoothing: float = 0.0,
    num_classes: int = NC,
) -> Mixer[Any]:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    kw: dict[str, Any] = dict(label_smoothing=label_smoothing, prob=prob, mode=mode, pairing=pairing)
    if kind == "fmix":
        return FMix(num_classes, generator=gen, **kw)
    if kind == "fmix_cell":
        return FMix(num_classes, cell_size=CELL, generator=gen, **kw)
    if kind == "resizemix":
        return ResizeMix(num_classes, generator=gen, **kw)
    if kind == "resizemix_patch":
        return ResizeMix(num_classes, scale=(0.3, 1.0), patch_size=CELL, generator=gen, **kw)
    if kind == "saliencymix":
        return SaliencyMix(num_classes, generator=gen, **kw)
    if kind == "saliencymix_patch":
        return SaliencyMix(num_classes, patch_size=CELL, generator=gen, **kw)
    if kind == "gridmix":
        return GridMix(num_classes, cell_sizes=(2, 4), generator=gen, **kw)
    if kind == "tokenmix":
        return TokenMix(num_classes, patch_size=CELL, min_tokens=2, generator=gen, **kw)
    if kind == "switch":
        return Switch([FMix(num_classes, **kw), ResizeMix(num_classes, **kw), SaliencyMix(num_classes, **kw)], generator=gen)
    raise AssertionError(kind)


def id_images(b: int, hh: int = H, ww: int = W, seed: int = 0) -> Tensor:
    """Channel 0 holds the sample's index, channels 1-2 random texture (distinct images, a saliency to find)."""
    ids = torch.arange(b, dtype=torch.float32)[:, None, None, None].expand(b, 1, hh, ww)
    return torch.cat([ids, torch.rand(b, 2, hh, ww, generator=torch.Generator().manual_seed(seed))], dim=1)


def inner(params: Any) -> Any:
    return params.params if isinstance(params, SwitchParams) else params


# ====================================================================== smoke
@pytest.mark.parametrize("kind", KINDS)
def test_smoke(kind: str) -> None:
    mixer = make(kind, mode="elem", pairing="derangement", prob=0.5)
    text = repr(mixer)
    assert text.startswith(type(mixer).__name__ + "(")
    assert "mode=elem" in text and "pairing=derangement" in text and "prob=0.5" in text
    x, y = batch(4)
    mixed, lm = mixer(x, y)
    assert isinstance(mixed, Tensor) and isinstance(lm, TokenLabelMap)
    lm.check()
    only_images = mixer(x)
    assert isinstance(only_images, Tensor) and only_images.shape == x.shape
    mixer.apply(lambda m: None)


# ====================================================================== exception
def _bad_calls() -> list[tuple[str, Callable[[], object], str]]:
    x, y = batch(3)
    unplaced = SaliencyMix(NC).sample((3, 3, H, W))
    return [
        ("fmix alpha", lambda: FMix(NC, alpha=0.0), "alpha must be a finite number > 0"),
        ("fmix decay 0", lambda: FMix(NC, decay_power=0.0), r"decay_power must be a finite number > 0.*got 0.0"),
        ("fmix decay inf", lambda: FMix(NC, decay_power=float("inf")), "decay_power must be"),
        ("fmix cell 0", lambda: FMix(NC, cell_size=0), "cell_size must be a positive number"),
        ("fmix cell not dividing", lambda: FMix(NC, cell_size=5)(x, y), "cell_size=5 does not divide the image size 16x12"),
        ("fmix past 2**24 cells", lambda: FMix(NC).sample((1, 1, 4097, 4097)), r"exact up to 2\*\*24 cells.*give a cell_size"),
        ("resize scale reversed", lambda: ResizeMix(NC, scale=(0.8, 0.1)), r"scale must satisfy 0 <= min <= max <= 1.*\(0.8, 0.1\)"),
        ("resize scale > 1", lambda: ResizeMix(NC, scale=(0.1, 1.5)), "scale must satisfy"),
        ("resize patch not dividing", lambda: ResizeMix(NC, patch_size=5)(x, y), "patch_size=5 does not divide"),
        ("resize patch 0", lambda: ResizeMix(NC, patch_size=0), "patch_size must be a positive number"),
        ("saliency alpha", lambda: SaliencyMix(NC, alpha=-1.0), "alpha must be a finite number > 0"),
        ("saliency patch not dividing", lambda: SaliencyMix(NC, patch_size=5)(x, y), "patch_size=5 does not divide"),
        ("saliency unplaced map", lambda: SaliencyMix(NC).label_map(y, params=unplaced), "not placed yet.*SaliencyMix.place"),
        ("grid sizes empty", lambda: GridMix(NC, cell_sizes=()), "cell_sizes must be distinct positive numbers"),
        ("grid sizes repeated", lambda: GridMix(NC, cell_sizes=(4, 4)), "cell_sizes must be distinct"),
        ("grid size 0", lambda: GridMix(NC, cell_sizes=(0, 4)), "cell_sizes must be distinct positive"),
        ("grid size not dividing", lambda: GridMix(NC, cell_sizes=(4, 8))(x, y), "cell size=8 does not divide the image size 16x12"),
        ("tokenmix patch not dividing", lambda: TokenMix(NC, patch_size=5)(x, y), "cell_size=5 does not divide"),
        ("tokenmix min tokens", lambda: TokenMix(NC, min_tokens=0), "min_cells and max_cells must be >= 1"),
        ("bad mode", lambda: FMix(NC, mode="sample"), r"mode must be one of"),  # type: ignore[arg-type]
        ("bad pairing", lambda: ResizeMix(NC, pairing="shift"), r"pairing must be one of"),  # type: ignore[arg-type]
        ("prob > 1", lambda: GridMix(NC, prob=2.0), r"prob must lie in \[0, 1\]"),
        ("replay on bigger batch", lambda: make("resizemix")(*batch(5), params=make("resizemix").sample((3, 3, H, W))), "params were drawn for 3 images"),
    ]


@pytest.mark.parametrize(("case", "call", "match"), _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_exception(case: str, call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"kind": "fmix", "num_classes": 10, "decay_power": 0}, "decay_power"),
        ({"kind": "resizemix", "num_classes": 10, "scale": [0.9, 0.1]}, "scale must satisfy"),
        ({"kind": "gridmix", "num_classes": 10, "cell_sizes": []}, "cell_sizes"),
        ({"kind": "tokenmix", "num_classes": 10, "min_tokens": 0}, "min_tokens"),
        ({"kind": "saliencymix", "num_classes": 10, "sigma": 2}, "sigma"),
    ],
)
def test_exception_config(cfg: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TypeAdapter(MixerConfig).validate_python(cfg).build()


# ====================================================================== cardinality
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pairing", PAIRINGS)
def test_cardinality(kind: str, mode: str, pairing: str) -> None:
    for b in (1, 2, 3, 5):
        x, y = batch(b, seed=b)
        mixer = make(kind, mode=mode, pairing=pairing, seed=b)
        mixed, lm = mixer(x, y)
        params = inner(mixer.last_params)
        name = kind if kind != "switch" else ("fmix" if isinstance(params, CellParams) else "resizemix")
        assert mixed.shape == (b, 3, H, W) and mixed.dtype == x.dtype
        assert lm.sources.shape == (b, 2) and lm.mask.shape == (b, 2, *MASK_GRID[name])
        assert lm.image_weights.shape == (b, 2) and lm.image_size == (H, W)
        assert lm.image_targets().shape == (b, NC)
        assert lm.token_weights((H // CELL, W // CELL)).shape == (b, (H // CELL) * (W // CELL), 2)
        partner = lm.sources[:, 1]
        assert sorted(partner.tolist()) == list(range(b))
        fixed = partner == torch.arange(b)
        if pairing == "flip":
            assert torch.equal(partner, torch.arange(b).flip(0))
        if pairing == "flip" or mode == "pair":
            assert int(fixed.sum()) == b % 2
        else:
            assert int(fixed.sum()) == (1 if b == 1 else 0)
        assert (lm.mask.dense()[fixed, 0] == 1).all() and (lm.image_weights[fixed, 0] == 1).all()
        assert torch.equal(mixed[fixed], x[fixed])
        soft = torch.nn.functional.one_hot(y, NC).float()
        assert mixer(x, soft, params=mixer.last_params)[1].image_targets().shape == (b, NC)


# ====================================================================== unmixed samples
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unmixed_samples_come_back_bit_identical(kind: str, dtype: torch.dtype) -> None:
    """No ``1 * x + 0 * y`` for samples left unmixed: -0.0 keeps its sign and a partner's inf does not leak as NaN."""
    b = 8
    x = torch.rand(b, 3, H, W, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[:, :, ::3, ::2] = -0.0
    x[:, 1, 0, 0] = float("inf")
    unmixed_seen = 0
    for seed in range(6):
        mixer = make(kind, mode="elem", pairing="derangement", prob=0.5, seed=seed)
        out, _ = mixer(x, torch.arange(b) % NC)
        applied = inner(mixer.last_params).applied
        keep = ~applied
        unmixed_seen += int(keep.sum())
        assert torch.equal(out[keep].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           x[keep].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert unmixed_seen > 0


# ====================================================================== feature
def test_feature_resizemix_pastes_the_shrunk_partner() -> None:
    """Inside the box: ``F.interpolate(partner, box size, "nearest-exact")``; outside: the sample itself."""
    x = torch.rand(6, 3, 24, 20, generator=torch.Generator().manual_seed(0))
    mixer = ResizeMix(NC, mode="elem", pairing="derangement", generator=torch.Generator().manual_seed(3))
    out, lm = mixer(x, torch.arange(6))
    p = mixer.last_params
    assert isinstance(p, ResizeParams) and isinstance(lm.mask, BoxMask)
    for i, (y0, y1, x0, x1) in enumerate(p.pixel_boxes().tolist()):
        inside = torch.zeros(24, 20, dtype=torch.bool)
        inside[y0:y1, x0:x1] = True
        assert torch.equal(out[i][:, ~inside], x[i][:, ~inside])
        if y1 > y0 and x1 > x0:
            ref = F.interpolate(x[p.partner[i]][None], size=(y1 - y0, x1 - x0), mode="nearest-exact")[0]
            assert torch.equal(out[i, :, y0:y1, x0:x1], ref)
        assert math.isclose(lm.image_weights[i, 1].item(), (y1 - y0) * (x1 - x0) / (24 * 20), abs_tol=1e-6)


@pytest.mark.parametrize("cell", [None, 4])
def test_feature_resizemix_planned_batch_paste_is_the_shrunk_partner(cell: int | None) -> None:
    """``mode="batch"``: the paste planned with the draws (one box, its source rows and columns, the mixed samples)
    writes ``F.interpolate(partner, box size, "nearest-exact")`` into every mixed sample's box and nothing else; an
    unmixed sample (the middle of an odd flipped batch, or the whole batch gated off) keeps its pixels; the same
    images as the params without the plan."""
    for b, prob, seed in ((6, 1.0, 0), (7, 1.0, 1), (7, 0.5, 2), (7, 0.5, 5), (1, 1.0, 3), (0, 1.0, 4)):
        x = torch.rand(b, 3, 24, 20, generator=torch.Generator().manual_seed(seed))
        mixer = ResizeMix(NC, scale=(0.2, 0.9), patch_size=cell, prob=prob)
        out, _ = mixer(x, torch.arange(b) % NC, generator=torch.Generator().manual_seed(seed))
        p = mixer.last_params
        assert isinstance(p, ResizeParams) and p.paste is not None and p.paste_samples is not None
        y0, y1, x0, x1 = p.paste
        assert p.paste_samples.tolist() == p.applied.nonzero()[:, 0].tolist()
        for i in range(b):
            if not p.applied[i]:
                assert torch.equal(out[i], x[i])
                continue
            assert p.pixel_boxes()[i].tolist() == [y0, y1, x0, x1]
            want = x[i].clone()
            want[:, y0:y1, x0:x1] = F.interpolate(x[p.partner[i]][None], size=(y1 - y0, x1 - x0), mode="nearest-exact")[0]
            assert torch.equal(out[i], want)
        bare = dataclasses.replace(p, **{n: None for n in type(p).DERIVED}, drawn_from=None)
        assert torch.equal(mixer.mix(x, torch.arange(b) % NC, bare)[0], out)


@given(st.integers(1, 6), st.sampled_from([(24, 20), (16, 16), (7, 33)]), seeds)
def test_resize_indices_of_both_axes_are_each_axis_own(b: int, size: tuple[int, int], seed: int) -> None:
    """``resize_indices`` (both axes in one pass, the device path's) against ``resize_index`` per axis and the box mask,
    bit for bit, empty and full boxes included."""
    g = torch.Generator().manual_seed(seed)
    hh, ww = size
    y = torch.randint(0, hh + 1, (b, 2), generator=g).sort(dim=1).values
    x = torch.randint(0, ww + 1, (b, 2), generator=g).sort(dim=1).values
    boxes = torch.cat([y, x], dim=1)
    boxes[0] = torch.tensor([0, hh, 0, ww])  # one whole image
    rows, cols, inside = resize_indices(boxes, size, inside=True)
    assert torch.equal(rows, resize_index(boxes[:, 0], boxes[:, 1], hh))
    assert torch.equal(cols, resize_index(boxes[:, 2], boxes[:, 3], ww))
    assert inside is not None and torch.equal(inside, box_inside(boxes, size))
    assert resize_indices(boxes, size, inside=False)[2] is None


def test_feature_resizemix_box_sides_follow_the_scale() -> None:
    mixer = ResizeMix(NC, scale=(0.25, 0.5), mode="elem")
    p = mixer.sample((300, 3, 40, 80), generator=torch.Generator().manual_seed(0))
    h, w = p.boxes[:, 1] - p.boxes[:, 0], p.boxes[:, 3] - p.boxes[:, 2]
    assert h.min() >= 10 and h.max() <= 20 and w.min() >= 20 and w.max() <= 40
    assert ((p.boxes[:, 0] >= 0) & (p.boxes[:, 1] <= 40) & (p.boxes[:, 2] >= 0) & (p.boxes[:, 3] <= 80)).all()
    assert len(set(p.boxes[:, 0].tolist())) > 10  # the box moves
    tau_h = h.float() / 40
    assert (tau_h.mean() - 0.375).abs() < 0.03  # uniform in [0.25, 0.5], floored to whole pixels


def test_feature_saliencymix_box_covers_the_partners_bright_square() -> None:
    gen = torch.Generator().manual_seed(0)
    x = 0.2 * torch.rand(4, 3, 32, 32, generator=gen)
    squares = [(2, 4), (20, 6), (8, 22), (24, 24)]  # top-left corner of a 6 x 6 bright square, one per image
    for i, (r, c) in enumerate(squares):
        x[i, :, r : r + 6, c : c + 6] += 0.8
    mixer = SaliencyMix(NC, alpha=1.0, mode="elem", generator=torch.Generator().manual_seed(1))
    out, lm = mixer(x, torch.arange(4))
    p = mixer.last_params
    assert isinstance(p, SaliencyParams) and p.boxes is not None and isinstance(lm.mask, BoxMask)
    cy, cx = saliency_peaks(x, (32, 32))
    for i, j in enumerate(p.partner.tolist()):
        r, c = squares[j]
        assert r <= int(cy[j]) < r + 6 and c <= int(cx[j]) < c + 6  # the peak is on the square
        y0, y1, x0, x1 = p.boxes[i].tolist()
        if y1 > y0 and x1 > x0:
            assert y0 <= int(cy[j]) < y1 and x0 <= int(cx[j]) < x1  # the box is centred there
            assert torch.equal(out[i, :, y0:y1, x0:x1], x[j, :, y0:y1, x0:x1])


def test_feature_saliency_peaks_on_the_token_grid() -> None:
    img = 0.2 * torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    img[:, :, 24:30, 36:42] += 0.8
    assert spectral_residual_saliency(img).shape == (1, 32, 48)
    cy, cx = saliency_peaks(img, (4, 6))  # 8 px cells
    assert (int(cy), int(cx)) == (3, 4) or (int(cy), int(cx)) == (3, 5)
    big = F.interpolate(img, size=(256, 384), mode="nearest")
    assert spectral_residual_saliency(big).shape == (1, 64, 64)  # OpenCV's working size


def test_feature_saliencymix_placed_params_replay_without_pixels() -> None:
    x, y = batch(4)
    mixer = SaliencyMix(NC, generator=torch.Generator().manual_seed(0))
    out, lm = mixer(x, y)
    placed = mixer.last_params
    assert isinstance(placed, SaliencyParams) and placed.boxes is not None
    assert mixer.place(placed, torch.zeros_like(x)) is placed  # replay never looks at the pixels again
    again, lm2 = mixer(x, y, params=placed)
    assert torch.equal(again, out) and maps_equal(lm, lm2)


class Recorder:
    """Wraps a function of a module and keeps every value it returned."""

    def __init__(self, real: Callable[..., Tensor]) -> None:
        self.real, self.values = real, []  # type: ignore[var-annotated]

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        out = self.real(*args, **kwargs)
        self.values.append(out)
        return out


@given(st.integers(1, 6), st.sampled_from([None, 2, 4]), st.sampled_from([0.5, 1.0, 3.0]), seeds)
def test_fmix_keeps_the_top_lambda_quantile_of_the_noise(b: int, cell: int | None, alpha: float, seed: int) -> None:
    mixer = FMix(NC, alpha=alpha, cell_size=cell, mode="elem", pairing="derangement")
    noise_rec, beta_rec = Recorder(fmix_module.fourier_noise), Recorder(fmix_module.draw_beta)
    with mock.patch.object(fmix_module, "fourier_noise", noise_rec), mock.patch.object(fmix_module, "draw_beta", beta_rec):
        _, lm = mixer(torch.rand(b, 1, H, W), torch.zeros(b, dtype=torch.long), generator=torch.Generator().manual_seed(seed))
    p = mixer.last_params
    assert isinstance(p, CellParams)
    noise, lam = noise_rec.values[0], beta_rec.values  # elem: a group, a lambda (a Python number) and a noise a sample
    assert len(lam) == b and noise.shape == (b, *p.grid)
    n = p.grid[0] * p.grid[1]
    for i in range(b):
        if not p.applied[i]:
            assert not p.cells[i].any()
            continue
        own = ~p.cells[i]
        assert int(own.sum()) == round(to_fp32(lam[i]) * n)  # lambda kept as fp32, then the nearest count
        if own.any() and (~own).any():
            assert noise[i][own].min() > noise[i][~own].max()  # the sample keeps the highest noise
    assert_close(lm.image_weights[:, 0], 1 - p.cells.float().mean((1, 2)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
@pytest.mark.parametrize("cell", [None, 4])
@pytest.mark.parametrize("b", [0, 1, 5, 6])
def test_fmix_draws_equal_the_composed_reference(mode: str, cell: int | None, b: int) -> None:
    """The sampler's one-buffer build equals its reference composed from the draws: the same generator's seed
    (``host_rng``), pairs and lambdas as Python numbers, then ``fourier_noise`` and ``top_cells`` on the same
    generator, bit for bit: the cells, their keep mask, the label cells and weights (the mask mean), and the
    pixels (an unmixed sample, from ``prob`` or the odd one out of a flipped batch, keeps everything)."""
    for prob, seed in ((1.0, 0), (0.5, 1), (0.5, 2), (1.0, 3)):
        mixer = FMix(NC, alpha=0.7, decay_power=2.5, cell_size=cell, mode=mode, prob=prob)  # type: ignore[arg-type]
        x, y = torch.rand(b, 3, H, W), torch.randint(0, NC, (b,))
        out, lm = mixer(x, y, generator=torch.Generator().manual_seed(seed))
        p = mixer.last_params
        assert isinstance(p, CellParams)
        gen = torch.Generator().manual_seed(seed)
        rng = host_rng(gen)
        pairs = draw_pairs(b, mode, "flip", prob, rng)  # type: ignore[arg-type]
        n = p.grid[0] * p.grid[1]
        keep = torch.tensor([round(to_fp32(draw_beta(0.7, rng)) * n) for _ in range(pairs.num_groups)], dtype=torch.long)
        noise = fmix_module.fourier_noise(pairs.num_groups, p.grid, 2.5, gen, torch.device("cpu"))
        group, applied = torch.tensor(pairs.group, dtype=torch.long), torch.tensor(pairs.applied, dtype=torch.bool)
        cells = fmix_module.top_cells(noise, keep)[group] & applied[:, None, None]
        assert torch.equal(p.cells, cells) and torch.equal(p.keep_cells(), ~cells)
        assert torch.equal(lm.mask.dense(), torch.stack([(~cells).float(), cells.float()], dim=1))
        assert torch.equal(lm.image_weights[:, 0], (~cells).float().mean((1, 2)))
        assert torch.equal(lm.image_weights[:, 1], 1.0 - lm.image_weights[:, 0])
        assert lm.sources.tolist() == [[i, j] for i, j in enumerate(pairs.partner)]
        pixels = cells.repeat_interleave(H // p.grid[0], 1).repeat_interleave(W // p.grid[1], 2)
        assert torch.equal(out, torch.where(pixels[:, None], x[torch.tensor(pairs.partner, dtype=torch.long)], x))


def test_fmix_noise_is_low_frequency() -> None:
    """Most of the energy of decay-3 noise sits in the lowest frequencies; decay 0.5 spreads it out."""
    gen = torch.Generator().manual_seed(0)
    for decay, low_share in ((3.0, 0.9), (0.5, 0.3)):
        noise = fmix_module.fourier_noise(64, (32, 32), decay, gen, torch.device("cpu"))
        power = torch.fft.rfft2(noise - noise.mean((1, 2), keepdim=True)).abs().square().sum(0)
        low = power[:4, :4].sum() + power[-3:, :4].sum()
        share = float(low / power.sum())
        assert (share > low_share) if decay == 3.0 else (share < low_share)


@given(st.integers(1, 5), st.sampled_from([(2, 4), (4,), (2, 4, 8)]), seeds)
def test_gridmix_cells_are_blocks_of_the_drawn_size(b: int, sizes: tuple[int, ...], seed: int) -> None:
    hh, ww = 16, 24
    mixer = GridMix(NC, cell_sizes=sizes, mode="elem")
    beta = Recorder(grid_module.draw_beta)  # Python draws: one lambda a group, rounded to fp32 as the params keep it
    with mock.patch.object(grid_module, "draw_beta", beta):
        out, lm = mixer(id_images(b, hh, ww), torch.zeros(b, dtype=torch.long), generator=torch.Generator().manual_seed(seed))
    p = mixer.last_params
    assert isinstance(p, CellParams)
    unit = math.gcd(*sizes)
    assert p.grid == (hh // unit, ww // unit)
    assert len(beta.values) == b  # elem: a group a sample
    lam = torch.tensor(beta.values, dtype=torch.float32)
    for i in range(b):
        if not p.applied[i]:
            assert not p.cells[i].any()
            continue
        # Some drawn size explains the mask: constant on its blocks, with floor((1 - lam) n) of them taken.
        fits = []
        for s in sizes:
            f = s // unit
            blocks = p.cells[i].unflatten(0, (hh // s, f)).unflatten(2, (ww // s, f))  # sh f sw f
            constant = bool((blocks == blocks[:, :1, :, :1]).all())
            count = int(blocks[:, 0, :, 0].sum())
            fits.append(constant and count == math.floor((1 - float(lam[i].double())) * (hh // s) * (ww // s)))
        assert any(fits)


def test_tokenmix_is_blockwise_mixing_on_the_token_grid() -> None:
    """Same draws as ``BlockwiseMix`` with ``cell_size = patch_size`` and TokenMix's smallest block."""
    x, y = batch(6)
    a = TokenMix(NC, patch_size=CELL, min_tokens=3, mode="elem")
    b = BlockwiseMix(NC, cell_size=CELL, min_cells=3, mode="elem")
    pa = a.sample(x.shape, generator=torch.Generator().manual_seed(5))
    pb = b.sample(x.shape, generator=torch.Generator().manual_seed(5))
    assert torch.equal(pa.cells, pb.cells) and pa.grid == (H // CELL, W // CELL)
    assert TokenMix(NC).sampler.min_cells == 14  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "cfg",
    [
        {"kind": "fmix", "num_classes": 10, "decay_power": 2.0, "cell_size": 4},
        {"kind": "resizemix", "num_classes": 10, "scale": [0.2, 0.6], "patch_size": 4},
        {"kind": "saliencymix", "num_classes": 10, "alpha": 0.5},
        {"kind": "gridmix", "num_classes": 10, "cell_sizes": [2, 4]},
        {"kind": "tokenmix", "num_classes": 10, "patch_size": 4, "min_tokens": 2},
        {"kind": "switch", "mixers": [{"kind": "fmix", "num_classes": 10}, {"kind": "resizemix", "num_classes": 10},
                                      {"kind": "saliencymix", "num_classes": 10}]},
    ],
)
def test_feature_configs_build_the_mixer(cfg: dict[str, Any]) -> None:
    mixer = TypeAdapter(MixerConfig).validate_python(cfg).build()
    expected = {"fmix": FMix, "resizemix": ResizeMix, "saliencymix": SaliencyMix, "gridmix": GridMix, "tokenmix": TokenMix,
                "switch": Switch}[cfg["kind"]]
    assert type(mixer) is expected
    x, y = batch(4)
    _, lm = mixer(x, y)
    lm.check()


def test_feature_switch_picks_each_new_mixer() -> None:
    switch = make("switch", seed=0)
    x, y = batch(4)
    kinds = set()
    for _ in range(30):
        out, lm = switch(x, y)
        p = switch.last_params
        assert isinstance(p, SwitchParams)
        kinds.add(type(p.params).__name__)
        assert torch.equal(switch(x, y, params=p)[0], out)  # replayable, SaliencyMix's placed boxes included
    assert kinds == {"CellParams", "ResizeParams", "SaliencyParams"}


# ====================================================================== gradcheck
@pytest.mark.parametrize("kind", ["fmix", "resizemix", "saliencymix", "gridmix"])
def test_gradcheck(kind: str) -> None:
    mixer = {"fmix": FMix(NC, mode="elem"), "resizemix": ResizeMix(NC, scale=(0.5, 1.0), mode="elem"),
             "saliencymix": SaliencyMix(NC, mode="elem"), "gridmix": GridMix(NC, cell_sizes=(2,), mode="elem")}[kind]
    x = torch.rand(3, 1, 4, 4, dtype=torch.float64, requires_grad=True)
    params = mixer.place(mixer.sample(x.shape, generator=torch.Generator().manual_seed(0)), x)
    y = torch.tensor([0, 1, 2])
    assert torch.autograd.gradcheck(lambda t: mixer.mix(t, y, params)[0], (x,), fast_mode=True)


# ====================================================================== dynamo
@pytest.mark.parametrize(("kind", "mode"), [(k, "batch") for k in KINDS] + [("resizemix", "elem"), ("saliencymix", "elem")])
def test_dynamo(kind: str, mode: str) -> None:
    """The apply step (SaliencyMix's placing included) compiles as one graph and equals eager, for two draws."""
    torch._dynamo.reset()
    mixer = make(kind, mode=mode, pairing="derangement")
    compiled = torch.compile(mixer.mix, backend="eager", fullgraph=True)
    x, y = batch(5)
    for seed in (0, 1):
        params = mixer.sample(x.shape, generator=torch.Generator().manual_seed(seed))
        if isinstance(params, SwitchParams):
            child = mixer.mixers[2]  # SaliencyMix: placing is traced too
            assert isinstance(child, Mixer)
            params = SwitchParams(choice=2, params=child.sample(x.shape, generator=torch.Generator().manual_seed(seed)))
        with torch.compiler.set_stance("fail_on_recompile" if seed else "default"):
            out, lm = compiled(x, y, params)
        ref_out, ref_lm = mixer.mix(x, y, params)
        assert torch.equal(out, ref_out)
        assert maps_equal(lm, ref_lm)


# ====================================================================== AugmentationSequential
@pytest.mark.parametrize("kind", KINDS)
def test_sequential_flip_then_mixer_equals_mix_of_flipped(kind: str) -> None:
    x, y = batch(4)
    seq = AugmentationSequential(K.RandomHorizontalFlip(p=1.0), make(kind, mode="elem", seed=7), data_keys=["input"])
    out = seq(x)
    reference = make(kind, mode="elem")
    params = reference.sample(x.shape, generator=torch.Generator().manual_seed(7))
    ref_out, ref_lm = reference.mix(x.flip(-1), y, params)
    assert torch.equal(out, ref_out)
    assert maps_equal(sequential_label_map(seq, y), ref_lm)
    assert torch.equal(seq(x, params=seq._params), out)


# ====================================================================== properties against the pixels
@given(st.sampled_from(KINDS), st.integers(1, 5), modes, pairings, st.sampled_from([0.5, 1.0]), seeds,
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_mixed_pixels_follow_the_map(kind: str, b: int, mode: str, pairing: str, prob: float, seed: int, dtype: torch.dtype) -> None:
    """Mask kinds: the pixels are the mask-weighted sources exactly. ResizeMix: outside its box the sample itself."""
    x, y = batch(b, seed=seed % 1000, dtype=dtype)
    mixer = make(kind, mode=mode, pairing=pairing, prob=prob)
    out, lm = mixer(x, y, generator=torch.Generator().manual_seed(seed))
    assert out.dtype == dtype
    partner = lm.sources[:, 1]
    w = lm.pixel_weights()[:, :1]  # b 1 H W
    if isinstance(inner(mixer.last_params), ResizeParams):  # the partner is shrunk: not its own pixels in place
        assert torch.equal(torch.where(w == 1, out, x), x)
        return
    compute = torch.float32 if dtype == torch.bfloat16 else dtype
    xc = x.to(compute)
    assert torch.equal(out, (w * xc + (1.0 - w) * xc[partner]).to(dtype))
    assert ((out == x) | (out == x[partner])).all()  # binary masks copy pixels


ALL_KINDS = [*(("paper", k) for k in PAPER_KINDS), *(("beyond", k) for k in KINDS)]


@given(st.sampled_from(ALL_KINDS), st.integers(0, 6), modes, st.sampled_from(["flip", "derangement", "roll"]),
       st.sampled_from([0.5, 1.0]), seeds, st.sampled_from([torch.float32, torch.bfloat16]),
       st.sampled_from(["channels_last", "slice"]))
def test_memory_layouts_and_the_autograd_path_mix_alike(
    kind: tuple[str, str], b: int, mode: str, pairing: str, prob: float, seed: int, dtype: torch.dtype, layout: str
) -> None:
    """The CPU's copy paths (cells and boxes pasted run by run, the fixed pairings' partners flipped or rolled,
    ResizeMix's one planned box) read the images' strides: a channels-last batch and a strided view give the
    contiguous batch's pixels and map bit for bit, and so does the select that a batch needing a gradient takes;
    the output keeps the input's dtype and shape. Every mixer, the paper's and the beyond ones."""
    x, y = batch(b, seed=seed % 1000, dtype=dtype)
    if pairing == "roll" and mode == "pair":
        pairing = "flip"  # roll forms a cycle, not pairs (refused)
    mixer = (make_paper if kind[0] == "paper" else make)(kind[1], mode=mode, pairing=pairing, prob=prob)
    if layout == "channels_last":
        laid = x.contiguous(memory_format=torch.channels_last)
    else:
        wide = torch.zeros(b, 3, H, W + 3, dtype=dtype)
        wide[..., 1 : 1 + W] = x
        laid = wide[..., 1 : 1 + W]
    out, lm = mixer(x, y, generator=torch.Generator().manual_seed(seed))
    out_laid, lm_laid = mixer(laid, y, generator=torch.Generator().manual_seed(seed))
    out_grad, lm_grad = mixer(laid.clone().requires_grad_(True), y, generator=torch.Generator().manual_seed(seed))
    assert out_laid.dtype == out_grad.dtype == dtype and out_laid.shape == out_grad.shape == x.shape
    assert torch.equal(out_laid, out) and maps_equal(lm_laid, lm)
    assert torch.equal(out_grad.detach(), out) and maps_equal(lm_grad, lm)


@given(st.sampled_from(PAIR_KINDS), st.integers(1, 5), modes, pairings, st.sampled_from([0.5, 1.0]), seeds, st.data())
def test_token_weights_are_the_pixel_fractions_read_back(
    kind: str, b: int, mode: str, pairing: str, prob: float, seed: int, data: st.DataObject
) -> None:
    """Channel 0 holds each image's id: the share of a token showing another id is the partner's weight, on any dividing grid."""
    mixer = make(kind, mode=mode, pairing=pairing, prob=prob)
    x = id_images(b, seed=seed % 997)
    out, lm = mixer(x, torch.arange(b) % NC, generator=torch.Generator().manual_seed(seed))
    lm.check()
    assert_close(lm.image_weights[:, 0], lm.mask.dense()[:, 0].mean((1, 2)), rtol=0, atol=1e-6)
    own = torch.arange(b, dtype=torch.float32)
    partner = lm.sources[:, 1]
    shown = out[:, 0]
    assert ((shown == own[:, None, None]) | (shown == partner[:, None, None].float())).all()  # ids are copied, never blended
    share = (shown != own[:, None, None]).float()  # b H W: 1 where the partner shows
    gh = data.draw(st.sampled_from([d for d in range(1, H + 1) if H % d == 0]))
    gw = data.draw(st.sampled_from([d for d in range(1, W + 1) if W % d == 0]))
    ref = share.unflatten(1, (gh, H // gh)).unflatten(3, (gw, W // gw)).mean(dim=(2, 4)).flatten(1)
    # A sample paired with itself shows its own id everywhere and is unmixed (weight 0 for the "partner").
    assert_close(lm.token_weights((gh, gw))[..., 1], ref, rtol=0, atol=1e-6)
    if kind in BOX_KINDS:
        assert isinstance(lm.mask, BoxMask)  # boxes: the map keeps four numbers a sample


@given(st.sampled_from(KINDS), st.integers(2, 5), modes, pairings, st.sampled_from([0.0, 0.1]), seeds)
def test_bf16_batch_keeps_class_ids_exact(kind: str, b: int, mode: str, pairing: str, smoothing: float, seed: int) -> None:
    nc = 1000
    ids = torch.tensor([257, 999, 256, 511, 300])[:b]
    x = torch.rand(b, 3, H, W, generator=torch.Generator().manual_seed(seed % 991)).to(torch.bfloat16)
    mixer = make(kind, mode=mode, pairing=pairing, label_smoothing=smoothing, num_classes=nc)
    out, lm = mixer(x, ids, generator=torch.Generator().manual_seed(seed))
    assert out.dtype == torch.bfloat16 and torch.equal(lm.labels, ids)
    targets = lm.image_targets()
    rows = torch.arange(b)
    partner = lm.sources[:, 1]
    expected = torch.full((b, nc), smoothing / nc)
    expected[rows, ids] += lm.image_weights[:, 0] * (1 - smoothing)
    expected[rows, ids[partner]] += lm.image_weights[:, 1] * (1 - smoothing)
    assert_close(targets, expected, rtol=0, atol=1e-6)


# ====================================================================== the CPU copy paths
@given(st.integers(1, 6), st.sampled_from([(16, 12), (4, 3), (8, 6), (1, 1)]), seeds)
def test_paste_cells_equals_the_select(b: int, grid: tuple[int, int], seed: int) -> None:
    """Copying the partner's runs gives the select's pixels bit for bit, and leaves the input alone."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(b, 3, H, W, generator=gen, dtype=torch.float64)
    partner = torch.randperm(b, generator=gen)
    cells = torch.rand(grid, generator=gen) < 0.5
    before = x.clone()
    out = paste_cells(x, partner, cells)
    assert torch.equal(out, select_images(x, partner, ~cells.expand(b, *grid))) and torch.equal(x, before)


@given(st.integers(1, 6), seeds)
def test_paste_boxes_equals_the_select(b: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(b, 3, H, W, generator=gen, dtype=torch.float64)
    partner = torch.randint(0, b, (b,), generator=gen)  # self-pairs included
    ys, xs = torch.randint(0, H + 1, (b, 2), generator=gen).sort(1).values, torch.randint(0, W + 1, (b, 2), generator=gen).sort(1).values
    boxes = torch.cat([ys, xs], dim=1)
    keep = ~box_inside(boxes, (H, W))
    assert torch.equal(paste_boxes(x, partner, boxes), select_images(x, partner, keep))


def test_shared_cells_only_when_every_mixed_sample_shares_them() -> None:
    x, y = batch(5)
    for mode, prob, shared in (("batch", 1.0, True), ("batch", 0.0, True), ("elem", 1.0, False), ("pair", 1.0, False)):
        mixer = FMix(NC, cell_size=CELL, mode=mode, prob=prob)  # type: ignore[arg-type]
        p = mixer.sample(x.shape, generator=torch.Generator().manual_seed(0))
        cells = shared_cells(p)
        assert (cells is not None) == shared
        if cells is not None:
            assert torch.equal(p.cells[p.applied], cells.expand(int(p.applied.sum()), *cells.shape))


@given(st.sampled_from(["fmix", "fmix_cell"]), st.integers(1, 6), pairings, st.sampled_from([0.5, 1.0]), seeds)
def test_fmix_shared_mask_map_equals_the_dense_map(kind: str, b: int, pairing: str, prob: float, seed: int) -> None:
    """The expanded map of a batch-mode mask holds the same weights, bit for bit, as ``pair_label_map``'s dense one."""
    mixer = make(kind, mode="batch", pairing=pairing, prob=prob, label_smoothing=0.1)
    p = mixer.sample((b, 3, H, W), generator=torch.Generator().manual_seed(seed))
    y = torch.arange(b) % NC
    lm, dense = mixer.label_map_from(p, y), pair_label_map(p, y, NC, 0.1)
    assert maps_equal(lm, dense) and torch.equal(lm.image_targets(), dense.image_targets())
    for grid in ((H // CELL, W // CELL), (2, 3), (H, W)):
        assert torch.equal(lm.token_weights(grid), dense.token_weights(grid))
