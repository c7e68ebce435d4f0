"""kornia's test template for every mixer (smoke, exception, cardinality, feature, gradcheck, dynamo),
and the mixers inside ``kornia.augmentation.AugmentationSequential``.

Images are non-square (16 x 12) so a swapped height and width shows; cells are 4 px.
"""

from __future__ import annotations

from typing import Any, Callable

import kornia.augmentation as K
import pytest
import torch
from kornia.augmentation import AugmentationSequential
from torch import Tensor
from torch.testing import assert_close

from mixlabels import TokenLabelMap
from mixlabels.strategies import (
    BlockwiseMix,
    BoxParams,
    CellParams,
    CutMix,
    Mixer,
    MixToken,
    MixUp,
    MixUpParams,
    RandomPatchMix,
    Switch,
    SwitchParams,
    sequential_label_map,
)

NC = 10
H, W, CELL = 16, 12, 4
KINDS = ("cutmix", "cutmix_patch", "mixup", "random_patch", "blockwise", "mixtoken", "switch")
MODES = ("batch", "pair", "elem")
PAIRINGS = ("flip", "derangement")
# Mask resolution of each kind on an H x W image: the coarsest grid at which the map is exact.
MASK_GRID = {
    "cutmix": (H, W),
    "cutmix_patch": (H // CELL, W // CELL),
    "mixup": (1, 1),
    "random_patch": (H // CELL, W // CELL),
    "blockwise": (H // CELL, W // CELL),
    "mixtoken": (H // CELL, W // CELL),
}


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
    """One mixer of each kind with small cells, so 16 x 12 images have a few of them."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    kw: dict[str, Any] = dict(label_smoothing=label_smoothing, prob=prob, mode=mode, pairing=pairing)
    if kind == "cutmix":
        return CutMix(num_classes, generator=gen, **kw)
    if kind == "cutmix_patch":
        return CutMix(num_classes, patch_size=CELL, generator=gen, **kw)
    if kind == "mixup":
        return MixUp(num_classes, generator=gen, **kw)
    if kind == "random_patch":
        return RandomPatchMix(num_classes, cell_size=CELL, generator=gen, **kw)
    if kind == "blockwise":
        return BlockwiseMix(num_classes, cell_size=CELL, min_cells=2, generator=gen, **kw)
    if kind == "mixtoken":
        return MixToken(num_classes, patch_size=CELL, generator=gen, **kw)
    if kind == "switch":
        return Switch([MixUp(num_classes, **kw), CutMix(num_classes, patch_size=CELL, **kw)], generator=gen)
    raise AssertionError(kind)


def batch(b: int, hh: int = H, ww: int = W, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, 3, hh, ww, generator=g).to(dtype), torch.randint(0, NC, (b,), generator=g)


def maps_equal(a: TokenLabelMap, b: TokenLabelMap) -> bool:
    return (
        torch.equal(a.sources, b.sources)
        and torch.equal(a.mask.dense(), b.mask.dense())
        and torch.equal(a.image_weights, b.image_weights)
        and torch.equal(a.labels, b.labels)
        and (a.num_classes, a.image_size, a.label_smoothing, a.token_space)
        == (b.num_classes, b.image_size, b.label_smoothing, b.token_space)
    )


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
    lm.check()  # weights in [0, 1], summing to 1, labels in range
    only_images = mixer(x)  # kornia's calling convention: images in, images out
    assert isinstance(only_images, Tensor) and only_images.shape == x.shape
    mixer.apply(lambda m: None)  # nn.Module.apply must keep working (the apply step is named ``mix``)


# ====================================================================== exception
def _bad_calls() -> list[tuple[str, Callable[[], object], str]]:
    x, y = batch(3)
    cm = CutMix(NC)
    three = cm.sample((3, 3, H, W))
    return [
        ("3-d images", lambda: cm(x[0], y), r"must be a \(batch, channels, height, width\) tensor, got \(3, 16, 12\)"),
        ("5-d images", lambda: cm(x[None], y), r"got \(1, 3, 3, 16, 12\)"),
        ("int images", lambda: cm((x * 255).to(torch.uint8), y), "must be floating point.*torch.uint8"),
        ("long images", lambda: MixUp(NC)(x.long(), y), "must be floating point"),
        ("label too large", lambda: cm(x, torch.tensor([1, 2, NC])), r"class ids in \[1, 10\] but num_classes=10"),
        ("label negative", lambda: cm(x, torch.tensor([-1, 2, 3])), r"labels out of range.*\[-1, 3\]"),
        ("labels wrong batch", lambda: cm(x, y[:2]), "labels have batch size 2 but the images have 3"),
        ("scalar label", lambda: cm(x, torch.tensor(1)), "labels have batch size none"),
        ("2-d int labels", lambda: cm(x, y[:, None]), r"integer labels must have shape \(batch,\)"),
        ("soft labels wrong c", lambda: cm(x, torch.full((3, 5), 0.2)), r"soft labels must have shape.*got \(3, 5\)"),
        ("soft labels not normalised", lambda: cm(x, torch.rand(3, NC) + 1), "rows must sum to 1"),
        ("bool labels", lambda: cm(x, torch.tensor([True, False, True])), "dtype torch.bool"),
        ("patch_size not dividing", lambda: CutMix(NC, patch_size=5)(x, y), "patch_size=5 does not divide the image size 16x12"),
        ("cell_size not dividing", lambda: RandomPatchMix(NC, cell_size=8)(x, y), "cell_size=8 does not divide the image size 16x12"),
        ("block cell not dividing", lambda: BlockwiseMix(NC, cell_size=3)(x, y), "cell_size=3 does not divide"),
        ("token patch not dividing", lambda: MixToken(NC, patch_size=16)(x, y), "patch_size=16 does not divide"),
        ("alpha zero", lambda: CutMix(NC, alpha=0.0), r"alpha must be a finite number > 0.*got 0.0"),
        ("alpha negative", lambda: MixUp(NC, alpha=-1.0), "alpha must be a finite number > 0"),
        ("alpha nan", lambda: RandomPatchMix(NC, alpha=float("nan")), "got nan"),
        ("alpha inf", lambda: BlockwiseMix(NC, alpha=float("inf")), "got inf"),
        ("mixtoken alpha", lambda: MixToken(NC, alpha=0.0), "alpha must be"),
        ("prob > 1", lambda: MixUp(NC, prob=1.5), r"prob must lie in \[0, 1\].*got 1.5"),
        ("prob < 0", lambda: CutMix(NC, prob=-0.1), "got -0.1"),
        ("bad mode", lambda: MixUp(NC, mode="sample"), r"mode must be one of \('batch', 'pair', 'elem'\).*'sample'"),  # type: ignore[arg-type]
        ("bad pairing", lambda: CutMix(NC, pairing="shift"), r"pairing must be one of \('flip', 'derangement', 'roll'\).*'shift'"),  # type: ignore[arg-type]
        ("num_classes 0", lambda: MixUp(0), "num_classes must be >= 1, got 0"),
        ("smoothing 1", lambda: CutMix(NC, label_smoothing=1.0), r"label_smoothing must lie in \[0, 1\)"),
        ("minmax reversed", lambda: CutMix(NC, minmax=(0.8, 0.2)), "minmax must satisfy 0 <= min < max <= 1"),
        ("minmax no size", lambda: CutMix(NC, minmax=(0.1, 0.2))(torch.rand(2, 1, 4, 4), y[:2]), "gives no box size on a 4x4 grid"),
        ("ratio > 1", lambda: RandomPatchMix(NC, ratio=1.5), r"ratio must lie in \[0, 1\]"),
        ("aspect 0", lambda: BlockwiseMix(NC, min_aspect=0.0), "0 < min_aspect <= max_aspect"),
        ("aspect reversed", lambda: BlockwiseMix(NC, min_aspect=2.0, max_aspect=1.0), "0 < min_aspect <= max_aspect"),
        ("min_cells 0", lambda: BlockwiseMix(NC, min_cells=0), "min_cells and max_cells must be >= 1"),
        ("cell_size 0", lambda: RandomPatchMix(NC, cell_size=0), "cell_size must be a positive number"),
        ("patch_size 0", lambda: CutMix(NC, patch_size=0), "patch_size must be a positive number"),
        ("replay on bigger batch", lambda: cm(*batch(5), params=three), "params were drawn for 3 images of size \\(16, 12\\) but got 5"),
        ("replay on other size", lambda: cm(*batch(3, 8, 8), params=three), r"but got 3 images of size \(8, 8\)"),
        ("replay dict without params", lambda: cm(x, y, params={"batch_prob": torch.ones(3)}), "must hold the sampled params under 'mix_params'"),
        ("sample 3-d shape", lambda: cm.sample((3, H, W)), r"batch_shape must be \(batch, channels, height, width\)"),
        ("empty image", lambda: cm(torch.rand(3, 3, 0, 4), y), "positive height and width"),
        ("bad data_keys", lambda: cm(x, y, data_keys=["input", "mask"]), r"accepts data_keys \['input'\] or \['input', 'class'\]"),
        ("labels with input key", lambda: cm(x, y, data_keys=["input"]), "labels were given but data_keys is"),
        ("label_map before any call", lambda: CutMix(NC).label_map(y), "has not mixed a batch yet"),
        ("switch empty", lambda: Switch([]), "at least one mixer"),
        ("switch classes", lambda: Switch([MixUp(NC), CutMix(NC + 1)]), r"same num_classes, got \[10, 11\]"),
        ("switch probs length", lambda: Switch([MixUp(NC), CutMix(NC)], probs=[1.0]), r"one non-negative number per mixer \(2\)"),
        ("switch probs negative", lambda: Switch([MixUp(NC), CutMix(NC)], probs=[1.0, -1.0]), "non-negative"),
        ("switch probs zero", lambda: Switch([MixUp(NC), CutMix(NC)], probs=[0.0, 0.0]), "positive sum"),
        ("switch replay", lambda: make("switch")(*batch(5), params=make("switch").sample((3, 3, H, W))), "params were drawn for 3 images"),
    ]


@pytest.mark.parametrize(("case", "call", "match"), _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_exception(case: str, call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_exception_label_map_wrong_batch() -> None:
    cm = CutMix(NC)
    cm(*batch(3))
    with pytest.raises(ValueError, match="labels have batch size 5 but the images have 3"):
        cm.label_map(torch.arange(5))


def test_exception_sequential() -> None:
    x, y = batch(3)
    after = AugmentationSequential(CutMix(NC), K.RandomHorizontalFlip(p=1.0), data_keys=["input"])
    with pytest.raises(ValueError, match="has not run yet"):
        sequential_label_map(after, y)
    after(x)
    with pytest.raises(ValueError, match="RandomHorizontalFlip ran after CutMix and moves pixels"):
        sequential_label_map(after, y)
    no_mixer = AugmentationSequential(K.RandomHorizontalFlip(p=1.0), data_keys=["input"])
    no_mixer(x)
    with pytest.raises(ValueError, match="no mixer from strategies ran"):
        sequential_label_map(no_mixer, y)


# ====================================================================== cardinality
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pairing", PAIRINGS)
def test_cardinality(kind: str, mode: str, pairing: str) -> None:
    for b in (1, 2, 3, 5):
        x, y = batch(b, seed=b)
        mixer = make(kind, mode=mode, pairing=pairing, seed=b)
        mixed, lm = mixer(x, y)
        params = mixer.last_params
        inner = params.params if isinstance(params, SwitchParams) else params
        grid = MASK_GRID["mixup" if isinstance(inner, MixUpParams) else "cutmix_patch" if kind == "switch" else kind]
        assert mixed.shape == (b, 3, H, W) and mixed.dtype == x.dtype
        assert lm.sources.shape == (b, 2) and lm.mask.dense().shape == (b, 2, *grid)
        assert lm.image_weights.shape == (b, 2) and lm.image_size == (H, W)
        assert lm.image_targets().shape == (b, NC)
        assert lm.token_weights((H // CELL, W // CELL)).shape == (b, (H // CELL) * (W // CELL), 2)
        assert torch.equal(lm.sources[:, 0], torch.arange(b))
        partner = lm.sources[:, 1]
        assert sorted(partner.tolist()) == list(range(b))  # a permutation of the batch
        fixed = partner == torch.arange(b)
        if pairing == "flip":
            assert torch.equal(partner, torch.arange(b).flip(0))
        if pairing == "flip" or mode == "pair":  # pairs: an involution, one sample left over in odd batches
            assert torch.equal(partner[partner], torch.arange(b))
            assert int(fixed.sum()) == b % 2
        else:  # one random cycle: nobody keeps itself unless alone
            assert int(fixed.sum()) == (1 if b == 1 else 0)
        # A sample left with itself is unmixed: weight 1 everywhere, its own pixels and target.
        assert (lm.mask.dense()[fixed, 0] == 1).all() and (lm.image_weights[fixed, 0] == 1).all()
        assert torch.equal(mixed[fixed], x[fixed])
        assert (lm.image_targets()[fixed].argmax(1) == y[fixed]).all()
        soft = torch.nn.functional.one_hot(y, NC).float()
        assert mixer(x, soft, params=params)[1].image_targets().shape == (b, NC)


# ====================================================================== feature (hand-checked values)
def test_feature_mixup_hand_values() -> None:
    x = torch.stack([torch.ones(1, 2, 2), torch.zeros(1, 2, 2)])
    params = MixUpParams(partner=torch.tensor([1, 0]), applied=torch.tensor([True, True]), image_size=(2, 2), lam=torch.tensor([0.25, 0.25]))
    mixed, lm = MixUp(6, label_smoothing=0.3).mix(x, torch.tensor([2, 5]), params)
    assert mixed[0].unique().tolist() == [0.25] and mixed[1].unique().tolist() == [0.75]
    # Smoothing 0.3 over 6 classes: off 0.05, on 0.75; row 0 = 0.25 * t(2) + 0.75 * t(5).
    assert_close(lm.image_targets()[0], torch.tensor([0.05, 0.05, 0.225, 0.05, 0.05, 0.575]))
    assert_close(lm.image_targets()[1], torch.tensor([0.05, 0.05, 0.575, 0.05, 0.05, 0.225]))
    assert lm.mask.dense().shape == (2, 2, 1, 1) and lm.image_weights[:, 0].tolist() == [0.25, 0.25]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_feature_mixup_pixels_follow_the_label_weights(dtype: torch.dtype) -> None:
    """Mixing indicator images (1 for sample 0, 0 for sample 1) reads the pixel weights back:
    they are the fp32 label weights, 1 - lam formed in fp32 as in the map, then rounded once."""
    x = torch.stack([torch.ones(1, 2, 2), torch.zeros(1, 2, 2)]).to(dtype)
    lam = torch.tensor([0.1, 0.1])  # 1 - fp32(0.1) is not an fp32 number: rounding it in fp32 or fp64 differs
    params = MixUpParams(partner=torch.tensor([1, 0]), applied=torch.tensor([True, True]), image_size=(2, 2), lam=lam)
    mixed, lm = MixUp(NC).mix(x, torch.tensor([0, 1]), params)
    assert mixed.dtype == dtype
    assert (mixed[0] == lm.image_weights[0, 0].to(dtype)).all()
    assert (mixed[1] == lm.image_weights[1, 1].to(dtype)).all()


def _boxes(boxes: list[list[int]], grid: tuple[int, int], size: tuple[int, int]) -> BoxParams:
    b = len(boxes)
    return BoxParams(
        partner=torch.arange(b).flip(0), applied=torch.ones(b, dtype=torch.bool), image_size=size,
        boxes=torch.tensor(boxes), lam=torch.full((b,), 0.5), grid=grid,
    )


def test_feature_cutmix_pixel_box_hand_values() -> None:
    x = torch.stack([torch.arange(16.0).view(1, 4, 4), 100 + torch.arange(16.0).view(1, 4, 4)])
    mixed, lm = CutMix(NC).mix(x, torch.tensor([3, 7]), _boxes([[1, 3, 0, 2], [0, 1, 1, 4]], (4, 4), (4, 4)))
    assert mixed[0, 0].tolist() == [[0, 1, 2, 3], [104, 105, 6, 7], [108, 109, 10, 11], [12, 13, 14, 15]]
    assert mixed[1, 0].tolist() == [[100, 1, 2, 3], [104, 105, 106, 107], [108, 109, 110, 111], [112, 113, 114, 115]]
    assert lm.image_weights.tolist() == [[0.75, 0.25], [0.8125, 0.1875]]  # 4 and 3 of 16 pixels pasted
    assert_close(lm.image_targets()[0, [3, 7]], torch.tensor([0.75, 0.25]))
    # On a 2x2 token grid the box [1, 3) x [0, 2) covers half of tokens 0 and 2.
    assert lm.token_weights((2, 2))[0, :, 1].tolist() == [0.5, 0.0, 0.5, 0.0]


def test_feature_cutmix_snapped_box_hand_values() -> None:
    x = torch.stack([torch.arange(16.0).view(1, 4, 4), 100 + torch.arange(16.0).view(1, 4, 4)])
    params = _boxes([[0, 1, 1, 2], [0, 1, 1, 2]], (2, 2), (4, 4))  # the top-right 2x2 cell
    mixed, lm = CutMix(NC, patch_size=2).mix(x, torch.tensor([3, 7]), params)
    assert mixed[0, 0].tolist() == [[0, 1, 102, 103], [4, 5, 106, 107], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert lm.mask.dense()[0, 0].tolist() == [[1.0, 0.0], [1.0, 1.0]]
    assert lm.token_weights((4, 4))[0, :, 1].view(4, 4).tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]


def test_feature_cells_hand_values() -> None:
    x = torch.stack([torch.zeros(1, 4, 6), torch.ones(1, 4, 6)])
    cells = torch.tensor([[[True, False, False], [False, False, True]], [[False, False, False], [False, False, False]]])
    params = CellParams(partner=torch.tensor([1, 0]), applied=torch.tensor([True, False]), image_size=(4, 6), cells=cells, grid=(2, 3))
    for mixer in (RandomPatchMix(NC, cell_size=2), BlockwiseMix(NC, cell_size=2)):
        mixed, lm = mixer.mix(x, torch.tensor([0, 1]), params)
        assert mixed[0, 0].tolist() == [[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1]]
        assert torch.equal(mixed[1], x[1])
        assert_close(lm.image_weights[:, 0], torch.tensor([4 / 6, 1.0]))


def test_feature_random_patch_fixed_ratio() -> None:
    x, y = batch(4)
    mixed, lm = RandomPatchMix(NC, cell_size=CELL, ratio=0.25)(x, y)
    assert (lm.mask.dense()[:, 1].sum((1, 2)) == 3).all()  # floor(0.25 * 12) of the 12 cells, the same cells in batch mode
    assert (lm.mask.dense()[:, 1] == lm.mask.dense()[:1, 1]).all()
    assert lm.image_weights[:, 0].tolist() == [0.75] * 4
    full, lm_full = RandomPatchMix(NC, cell_size=CELL, ratio=1.0)(x, y)
    assert torch.equal(full, x.flip(0)) and (lm_full.image_weights[:, 0] == 0).all()
    none, lm_none = RandomPatchMix(NC, cell_size=CELL, ratio=0.0)(x, y)
    assert torch.equal(none, x) and (lm_none.image_weights[:, 0] == 1).all()


def test_feature_blockwise_single_square_block() -> None:
    # 9 target cells, blocks of exactly 9 cells with aspect 1: one 3x3 block, somewhere on the 8x8 grid.
    mixer = BlockwiseMix(NC, cell_size=2, ratio=9 / 64, min_cells=9, min_aspect=1.0, mode="elem")
    p = mixer.sample((16, 1, 16, 16), generator=torch.Generator().manual_seed(0))
    for cells in p.cells:
        rows, cols = cells.nonzero().unbind(1)
        assert cells.sum() == 9
        assert rows.max() - rows.min() == 2 and cols.max() - cols.min() == 2
    assert len({tuple(c.nonzero()[0].tolist()) for c in p.cells}) > 4  # the block moves


def test_feature_blockwise_reaches_target_count() -> None:
    mixer = BlockwiseMix(NC, cell_size=2, ratio=0.4, min_cells=4, mode="elem")
    p = mixer.sample((200, 1, 16, 16), generator=torch.Generator().manual_seed(1))
    counts = p.cells.sum((1, 2))
    assert (counts <= 25).all()  # never more than floor(0.4 * 64)
    assert counts.float().mean() > 24.5  # BEiT's give-up after 10 rejections is rare at 40 %
    assert_close(p.image_weight(), 1 - counts.float() / 64)


def test_feature_pair_mode_shares_draws_within_a_pair() -> None:
    x, y = batch(6)
    for kind in ("cutmix", "random_patch", "mixup"):
        mixer = make(kind, mode="pair", pairing="derangement", seed=4)
        mixed, lm = mixer(x, y)
        partner = lm.sources[:, 1]
        # Each takes the other's region: the two masks are the same, the weights swap.
        assert torch.equal(lm.mask.dense()[:, 0], lm.mask.dense()[partner, 0])
        assert torch.equal(lm.image_weights[:, 0], lm.image_weights[partner, 0])
        assert len(set(lm.image_weights[:, 0].tolist())) > 1  # but pairs draw independently


def test_feature_mixtoken_returns_images_and_token_map() -> None:
    x, y = batch(4)
    out, lm = MixToken(NC, patch_size=CELL, generator=torch.Generator().manual_seed(0))(x, y)
    assert out is x and lm.token_space and lm.mask.dense().shape == (4, 2, H // CELL, W // CELL)


def test_feature_switch_probability_one_picks_that_mixer() -> None:
    switch = Switch([MixUp(NC), CutMix(NC, patch_size=CELL)], probs=[0.0, 2.0], generator=torch.Generator().manual_seed(0))
    assert switch.probs == (0.0, 1.0)
    x, y = batch(4)
    for _ in range(5):
        _, lm = switch(x, y)
        assert switch.last_params is not None and switch.last_params.choice == 1
        assert isinstance(switch.last_params.params, BoxParams) and lm.mask.dense().shape == (4, 2, H // CELL, W // CELL)


# ====================================================================== gradcheck
@pytest.mark.parametrize("kind", ["cutmix", "mixup", "random_patch"])
def test_gradcheck(kind: str) -> None:
    mixer = make(kind, mode="elem")
    x = torch.rand(3, 1, 4, 4, dtype=torch.float64, requires_grad=True)
    if kind == "random_patch":
        mixer = RandomPatchMix(NC, cell_size=2, mode="elem")
    params = mixer.sample(x.shape, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2])
    assert torch.autograd.gradcheck(lambda t: mixer.mix(t, y, params)[0], (x,), fast_mode=True)


# ====================================================================== dynamo
# Every kind in the default batch mode; boxes take another path per sample (elem), so those twice.
@pytest.mark.parametrize(("kind", "mode"), [(k, "batch") for k in KINDS] + [("cutmix", "elem"), ("cutmix_patch", "elem")])
def test_dynamo(kind: str, mode: str) -> None:
    """The apply step compiles as one graph and equals eager, for two different draws."""
    torch._dynamo.reset()  # ``Mixer.mix`` is one code object: start each kind under a fresh cache
    mixer = make(kind, mode=mode, pairing="derangement")
    compiled = torch.compile(mixer.mix, backend="eager", fullgraph=True)
    x, y = batch(5)
    for seed in (0, 1):
        params = mixer.sample(x.shape, generator=torch.Generator().manual_seed(seed))
        if isinstance(params, SwitchParams):  # the same child both times: the choice is a Python int
            child = mixer.mixers[1]
            assert isinstance(child, Mixer)
            params = SwitchParams(choice=1, params=child.sample(x.shape, generator=torch.Generator().manual_seed(seed)))
        # The second draw must reuse the graph: params are data, not constants baked into it.
        with torch.compiler.set_stance("fail_on_recompile" if seed else "default"):
            out, lm = compiled(x, y, params)
        ref_out, ref_lm = mixer.mix(x, y, params)
        assert torch.equal(out, ref_out)
        assert maps_equal(lm, ref_lm)


# ====================================================================== AugmentationSequential
@pytest.mark.parametrize("kind", KINDS)
def test_sequential_flip_then_mixer_equals_mix_of_flipped(kind: str) -> None:
    """With a certain flip and a seeded mixer, the container's output and map are known exactly."""
    x, y = batch(4)
    seq = AugmentationSequential(K.RandomHorizontalFlip(p=1.0), make(kind, mode="elem", seed=7), data_keys=["input"])
    out = seq(x)
    reference = make(kind, mode="elem")
    params = reference.sample(x.shape, generator=torch.Generator().manual_seed(7))
    ref_out, ref_lm = reference.mix(x.flip(-1), y, params)
    assert torch.equal(out, ref_out)
    assert maps_equal(sequential_label_map(seq, y), ref_lm)
    assert torch.equal(seq(x, params=seq._params), out)  # kornia's replay of the recorded params


def test_sequential_with_color_jitter_before_and_after() -> None:
    x, y = batch(4)
    flip, jitter = K.RandomHorizontalFlip(p=1.0), K.ColorJitter(0.2, 0.2, 0.2, 0.05, p=1.0)
    mixer = CutMix(NC, patch_size=CELL, mode="elem", generator=torch.Generator().manual_seed(3))
    seq = AugmentationSequential(flip, jitter, mixer, K.ColorJitter(0.1, p=1.0), data_keys=["input"])
    out = seq(x)
    lm = sequential_label_map(seq, y)  # intensity changes after the mixer are allowed
    before = AugmentationSequential(flip, jitter, data_keys=["input"])(x, params=seq._params[:2])
    mixed = lm.mix_pixels(before)
    assert not torch.equal(mixed, out)  # the last jitter changed the pixels ...
    mixed_only = AugmentationSequential(flip, jitter, mixer, data_keys=["input"])(x, params=seq._params[:3])
    assert torch.equal(mixed_only, mixed)  # ... and without it the map reproduces them exactly
    assert (lm.mask.dense()[:, 1] > 0).any()


def test_sequential_label_map_follows_the_pixels() -> None:
    """Channel 0 of every pixel holds its sample's id: the map must name that sample's label there."""
    b = 6
    ids = torch.arange(b, dtype=torch.float32)
    cols = torch.arange(W, dtype=torch.float32)
    x = torch.stack([ids[:, None, None].expand(b, H, W), cols.expand(b, H, W)], dim=1)
    y = torch.tensor([9, 4, 1, 7, 0, 3])
    for mixer in (make("cutmix", mode="elem", seed=1), make("blockwise", mode="elem", seed=2), make("random_patch", mode="pair", pairing="derangement", seed=3)):
        seq = AugmentationSequential(K.RandomHorizontalFlip(p=0.5), K.RandomVerticalFlip(p=0.5), mixer, data_keys=["input"])
        out = seq(x)
        lm = sequential_label_map(seq, y)
        came_from = out[:, 0].long()  # (b, H, W) sample each pixel shows
        assert (came_from != torch.arange(b)[:, None, None]).any()
        assert torch.equal(lm.dense_pixel_targets().argmax(1), y[came_from])
        flip_params = seq._params[0].data
        assert isinstance(flip_params, dict)
        flipped = flip_params["batch_prob"] > 0.5
        want_cols = torch.where(flipped[came_from], W - 1 - cols, cols)
        assert torch.equal(out[:, 1], want_cols)  # pixels come from the flipped partner


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_sequential_on_gpu_equals_cpu(kind: str) -> None:
    x, y = batch(4)
    seq = AugmentationSequential(K.RandomHorizontalFlip(p=1.0), make(kind, mode="elem"), K.ColorJitter(0.1, p=1.0), data_keys=["input"])
    out = seq(x.cuda())
    lm = sequential_label_map(seq, y.cuda())
    assert out.device.type == "cuda" and lm.mask.dense().device.type == "cuda"
    no_jitter = AugmentationSequential(K.RandomHorizontalFlip(p=1.0), seq[1], data_keys=["input"])
    mixed = no_jitter(x.cuda(), params=seq._params[:2])
    flipped = x.cuda().flip(-1)
    assert_close(mixed, flipped if lm.token_space else lm.mix_pixels(flipped))


# ====================================================================== the CPU's copy paths
@pytest.mark.parametrize("pairing", ["flip", "roll", "derangement"])
def test_gather_partners_of_every_pairing_is_the_indexing(pairing: str) -> None:
    """On the CPU the fixed pairings are gathered as a flip or a roll of the batch: the same pixels as the indexing,
    in the images' memory format, with a gradient."""
    import random

    from mixlabels.strategies._base import gather_partners
    from mixlabels.strategies._host_draws import draw_pairs

    for b in (1, 2, 7):
        partner = torch.tensor(draw_pairs(b, "elem", pairing, 1.0, random.Random(b)).partner)  # type: ignore[arg-type]
        for x in (torch.rand(b, 3, H, W), torch.rand(b, 3, H, W).contiguous(memory_format=torch.channels_last)):
            got = gather_partners(x, partner)
            assert torch.equal(got, x[partner]) and got.stride() == x[partner].stride()
        x = torch.rand(b, 3, H, W, requires_grad=True)
        gather_partners(x, partner).sum().backward()
        assert x.grad is not None and torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("mode", ["pair", "elem"])
@pytest.mark.parametrize("patch", [None, CELL])
def test_cutmix_boxes_per_sample_pasted_on_the_cpu_are_the_select(mode: str, patch: int | None) -> None:
    """A box per sample, on the CPU: the batch copied and each box pasted from its partner gives the select's pixels,
    unmixed samples (gate, odd batch) their own; with a gradient the select itself runs, with the same pixels."""
    from mixlabels.strategies._base import select_images

    for b, seed in ((7, 0), (8, 1), (1, 2)):
        x, y = batch(b, seed=seed)
        mixer = CutMix(NC, mode=mode, prob=0.7, patch_size=patch)  # type: ignore[arg-type]
        out, _ = mixer(x, y, generator=torch.Generator().manual_seed(seed))
        p = mixer.last_params
        assert torch.equal(out, select_images(x, p.partner, p.keep_cells()))
        xg = x.clone().requires_grad_()
        assert torch.equal(mixer.mix(xg, y, p)[0], out)
