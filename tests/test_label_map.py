"""TokenLabelMap: invariants (property-based), parity with timm, and the catalogue of bad inputs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from timm.data.mixup import mixup_target
from torch.testing import assert_close

from mixlabels import BoxMask, CellMask, TokenLabelMap, class_distributions

SIZES = [8, 12, 16, 24, 32]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def box_case(draw: st.DrawFn) -> tuple[int, int, list[tuple[int, int, int, int]], tuple[int, int]]:
    """An image size, one random box per sample, and a grid that divides the image."""
    hh = draw(st.sampled_from(SIZES))
    ww = draw(st.sampled_from(SIZES))
    b = draw(st.integers(1, 4))
    boxes = []
    for _ in range(b):
        y0 = draw(st.integers(0, hh))
        y1 = draw(st.integers(y0, hh))
        x0 = draw(st.integers(0, ww))
        x1 = draw(st.integers(x0, ww))
        boxes.append((y0, y1, x0, x1))
    grid = (draw(st.sampled_from(divisors(hh))), draw(st.sampled_from(divisors(ww))))
    return hh, ww, boxes, grid


def box_map(hh: int, ww: int, boxes: list[tuple[int, int, int, int]], num_classes: int = 10) -> TokenLabelMap:
    b = len(boxes)
    mask = torch.ones(b, hh, ww)
    for i, (y0, y1, x0, x1) in enumerate(boxes):
        mask[i, y0:y1, x0:x1] = 0.0  # the box is pasted from the partner
    partner = torch.arange(b).flip(0)
    labels = torch.arange(b) % num_classes
    return TokenLabelMap.from_mask(mask, partner, labels, num_classes=num_classes)


@given(box_case())
def test_token_weights_equal_brute_force_pixel_count(case: tuple[int, int, list[tuple[int, int, int, int]], tuple[int, int]]) -> None:
    hh, ww, boxes, (h, w) = case
    lm = box_map(hh, ww, boxes)
    got = lm.token_weights((h, w))
    ph, pw = hh // h, ww // w
    for i, (y0, y1, x0, x1) in enumerate(boxes):
        for r in range(h):
            for c in range(w):
                # Count the partner's pixels inside the token cell by intersecting intervals.
                oy = max(0, min(y1, (r + 1) * ph) - max(y0, r * ph))
                ox = max(0, min(x1, (c + 1) * pw) - max(x0, c * pw))
                frac = oy * ox / (ph * pw)
                assert math.isclose(got[i, r * w + c, 1].item(), frac, abs_tol=1e-6)
                assert math.isclose(got[i, r * w + c, 0].item(), 1 - frac, abs_tol=1e-6)


@given(box_case())
def test_weights_are_convex_and_regridding_preserves_image_weight(case: tuple[int, int, list[tuple[int, int, int, int]], tuple[int, int]]) -> None:
    hh, ww, boxes, grid = case
    lm = box_map(hh, ww, boxes)
    tw = lm.token_weights(grid)
    assert (tw >= 0).all()
    assert_close(tw.sum(-1), torch.ones(tw.shape[:2]))
    # The image weight is the area mean of the token weights on every grid.
    assert_close(tw.mean(1), lm.image_weights)
    for i, (y0, y1, x0, x1) in enumerate(boxes):
        assert math.isclose(lm.image_weights[i, 1].item(), (y1 - y0) * (x1 - x0) / (hh * ww), abs_tol=1e-6)


@given(
    st.sampled_from([3, 4, 6, 8, 12]),
    st.sampled_from(divisors(48)),
    st.integers(1, 3),
    st.integers(0, 2**31 - 1),
)
def test_cell_masks_regrid_to_finer_and_coarser_grids(mcells: int, g: int, b: int, seed: int) -> None:
    """A cell-level mask (RandomPatchMix) re-grids exactly to grids finer and coarser than its cells."""
    size = 48  # divisible by every mask resolution and every grid drawn
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, mcells, mcells, generator=gen).round()
    lm = TokenLabelMap.from_mask(mask, torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long), 3, image_size=(size, size))
    pix = mask.repeat_interleave(size // mcells, 1).repeat_interleave(size // mcells, 2)
    expected = torch.nn.functional.avg_pool2d(pix[:, None], size // g).flatten(1)
    assert_close(lm.token_weights((g, g))[..., 0], expected)
    assert_close(lm.token_weights((g, g)).mean(1), lm.image_weights)


@given(
    st.integers(1, 6),
    st.integers(2, 700),
    st.floats(0.0, 0.95),
    st.floats(0.0, 1.0),
    st.integers(0, 2**31 - 1),
)
def test_targets_match_timm_mixup_target(b: int, num_classes: int, smoothing: float, lam: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (b,), generator=gen)
    mask = torch.full((b, 1, 1), lam)
    lm = TokenLabelMap.from_mask(mask, torch.arange(b).flip(0), labels, num_classes, label_smoothing=smoothing)
    got = lm.image_targets()
    ref = mixup_target(labels, num_classes, lam=lam, smoothing=smoothing)
    assert_close(got, ref)
    assert_close(got.sum(-1), torch.ones(b))


@given(st.integers(1, 5), st.integers(2, 50), st.floats(0.0, 0.9), st.integers(0, 2**31 - 1))
def test_targets_rows_sum_to_one_for_soft_labels_and_any_weights(b: int, c: int, smoothing: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    soft = torch.rand(b, c, generator=gen).softmax(-1)
    mask = torch.rand(b, 4, 4, generator=gen)
    lm = TokenLabelMap.from_mask(mask, torch.randint(0, b, (b,), generator=gen), soft, c, label_smoothing=smoothing, image_size=(16, 16))
    t = lm.targets(lm.token_weights((8, 8)))
    assert t.shape == (b, 64, c)
    assert (t >= 0).all()
    assert_close(t.sum(-1), torch.ones(b, 64))


def test_class_ids_above_256_survive_a_bf16_image_pipeline() -> None:
    labels = torch.tensor([257, 999, 513, 1000 - 1])
    images = torch.rand(4, 3, 8, 8).to(torch.bfloat16)
    mask = torch.ones(4, 8, 8)
    mask[:, :4] = 0
    lm = TokenLabelMap.from_mask(mask, torch.tensor([1, 0, 3, 2]), labels, num_classes=1000)
    mixed = lm.mix_pixels(images)
    assert mixed.dtype == torch.bfloat16
    assert lm.mask.dense().dtype == torch.float32 and lm.image_weights.dtype == torch.float32
    t = lm.image_targets()
    assert t.dtype == torch.float32
    assert t[0, 257].item() == 0.5 and t[0, 999].item() == 0.5
    assert torch.equal(lm.labels, labels)


def test_mix_pixels_and_tokens_are_the_weighted_sources() -> None:
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(3, 2, 8, 8, generator=gen)
    mask = torch.rand(3, 2, 2, generator=gen)
    partner = torch.tensor([2, 0, 1])
    lm = TokenLabelMap.from_mask(mask, partner, torch.tensor([0, 1, 2]), 3, image_size=(8, 8))
    mixed = lm.mix_pixels(images)
    for i in range(3):
        m = mask[i].repeat_interleave(4, 0).repeat_interleave(4, 1)
        assert_close(mixed[i], images[i] * m + images[partner[i]] * (1 - m))
    tokens = torch.randn(3, 4, 5, generator=gen)
    mt = lm.mix_tokens(tokens, (2, 2))
    for i in range(3):
        w = mask[i].flatten()[:, None]
        assert_close(mt[i], tokens[i] * w + tokens[partner[i]] * (1 - w))


def test_unmixed_map_is_the_identity() -> None:
    labels = torch.tensor([1, 2, 0])
    lm = TokenLabelMap.unmixed(labels, 3, (8, 8), label_smoothing=0.1)
    assert_close(lm.image_targets(), class_distributions(labels, 3, 0.1))
    assert_close(lm.token_weights((4, 4)), torch.ones(3, 16, 1))
    lm.check()


def test_to_device_keeps_values() -> None:
    lm = box_map(8, 8, [(0, 4, 0, 4), (2, 8, 2, 8)])
    moved = lm.to("cpu")
    assert_close(moved.token_weights((2, 2)), lm.token_weights((2, 2)))


# --------------------------------------------------------------------------- boxes kept as boxes (from_boxes)


@st.composite
def cell_box_case(draw: st.DrawFn) -> tuple[tuple[int, int], tuple[int, int], list[tuple[int, int, int, int]], tuple[int, int]]:
    """An image size, a cell grid dividing it, one box per sample in cells, and a token grid.

    Boxes may be empty, inverted (``y1 < y0``) or cover the whole grid; the token grid may be
    finer or coarser than the cells, or neither (the lcm path of ``token_weights``).
    """
    hh, ww = draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES))
    gh, gw = draw(st.sampled_from(divisors(hh))), draw(st.sampled_from(divisors(ww)))
    boxes = [
        (draw(st.integers(0, gh)), draw(st.integers(0, gh)), draw(st.integers(0, gw)), draw(st.integers(0, gw)))
        for _ in range(draw(st.integers(1, 5)))
    ]
    tokens = (draw(st.sampled_from(divisors(hh))), draw(st.sampled_from(divisors(ww))))
    return (hh, ww), (gh, gw), boxes, tokens


def dense_box_map(
    size: tuple[int, int], grid: tuple[int, int], boxes: list[tuple[int, int, int, int]], partner: torch.Tensor, labels: torch.Tensor
) -> TokenLabelMap:
    """The reference: the same boxes as a dense cell mask, through ``from_mask``."""
    mask = torch.ones(len(boxes), *grid)
    for i, (y0, y1, x0, x1) in enumerate(boxes):
        mask[i, y0:y1, x0:x1] = 0.0  # an inverted box is an empty slice, as in the compact mask
    return TokenLabelMap.from_mask(mask, partner, labels, num_classes=10, label_smoothing=0.1, image_size=size)


@given(cell_box_case(), st.integers(0, 2**31 - 1))
def test_boxes_equal_the_dense_mask_bit_for_bit(
    case: tuple[tuple[int, int], tuple[int, int], list[tuple[int, int, int, int]], tuple[int, int]], seed: int
) -> None:
    """Every weight and target of a box map is the dense mask's, to the bit; reading never builds a cache."""
    size, grid, boxes, tokens = case
    b = len(boxes)
    gen = torch.Generator().manual_seed(seed)
    partner = torch.randint(0, b, (b,), generator=gen)
    labels = torch.randint(0, 10, (b,), generator=gen)
    lm = TokenLabelMap.from_boxes(torch.tensor(boxes), grid, partner, labels, 10, label_smoothing=0.1, image_size=size)
    ref = dense_box_map(size, grid, boxes, partner, labels)
    images = torch.rand(b, 3, *size, generator=gen)
    assert torch.equal(lm.sources, ref.sources)
    assert lm.mask.dense().dtype == torch.float32 and torch.equal(lm.mask.dense(), ref.mask.dense())
    assert torch.equal(lm.image_weights, ref.image_weights)  # torch.equal: the same bits, not close
    assert torch.equal(lm.image_targets(), ref.image_targets())
    for g in (tokens, grid, size):
        assert torch.equal(lm.token_weights(g), ref.token_weights(g))
    assert torch.equal(lm.pixel_weights(), ref.pixel_weights())
    assert torch.equal(lm.mix_pixels(images), ref.mix_pixels(images))
    assert torch.equal(lm.to("cpu").mask.dense(), ref.mask.dense())
    lm.check()
    assert isinstance(lm.mask, BoxMask) and isinstance(lm.to("cpu").mask, BoxMask)


def test_lambda_from_box_areas_equals_the_mean_at_imagenet_size() -> None:
    """Every box area on a 224x224 pixel grid gives the lambda ``mean`` gives (no rounding slip)."""
    sides = torch.arange(225)
    boxes = torch.stack([torch.zeros_like(sides), sides, torch.zeros_like(sides), sides.flip(0)], dim=1)  # b 4
    boxes = torch.cat([boxes, torch.stack([torch.zeros_like(sides), sides, torch.zeros_like(sides), sides], dim=1)])
    lm = TokenLabelMap.from_boxes(boxes, (224, 224), torch.zeros(len(boxes), dtype=torch.long), torch.zeros(len(boxes), dtype=torch.long), 2)
    assert torch.equal(lm.image_weights[:, 0], lm.mask.dense()[:, 0].mean(dim=(1, 2)))


def test_box_map_keeps_the_dataclass_surface() -> None:
    """``mask`` is still the second field, required, and ``replace`` still works (building the cells)."""
    assert [f.name for f in dataclasses.fields(TokenLabelMap)][:3] == ["sources", "mask", "image_weights"]
    lm = TokenLabelMap.from_boxes(torch.tensor([[0, 2, 1, 3]]), (4, 4), torch.tensor([0]), torch.tensor([1]), 3)
    smoothed = dataclasses.replace(lm, label_smoothing=0.1)
    assert torch.equal(smoothed.mask.dense(), lm.mask.dense()) and smoothed.label_smoothing == 0.1
    with pytest.raises(TypeError, match="mask"):
        TokenLabelMap(sources=lm.sources, image_weights=lm.image_weights, labels=lm.labels, num_classes=3, image_size=(4, 4))  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="tile the image"):
        TokenLabelMap.from_boxes(torch.tensor([[0, 2, 1, 3]]), (4, 4), torch.tensor([0]), torch.tensor([1]), 3, image_size=(6, 6))
    with pytest.raises(ValueError, match=r"\(batch, 4\) long"):
        TokenLabelMap.from_boxes(torch.tensor([[0.0, 2, 1, 3]]), (4, 4), torch.tensor([0]), torch.tensor([1]), 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_box_map_on_gpu_equals_the_dense_mask_on_gpu() -> None:
    """Off the CPU, lambda is the device's own ``mean`` of the cells, as the dense path computes it."""
    boxes = [(0, 5, 1, 7), (3, 3, 0, 8), (0, 8, 0, 8), (2, 6, 5, 6)]
    partner, labels = torch.tensor([1, 0, 3, 2]), torch.tensor([4, 2, 9, 0])
    lm = TokenLabelMap.from_boxes(torch.tensor(boxes).cuda(), (8, 8), partner.cuda(), labels.cuda(), 10, 0.1, (16, 16))
    ref = dense_box_map((16, 16), (8, 8), boxes, partner, labels).to("cuda")
    assert torch.equal(lm.image_weights, ref.image_weights) and torch.equal(lm.mask.dense(), ref.mask.dense())
    assert torch.equal(lm.token_weights((4, 4)), ref.token_weights((4, 4)))


# --------------------------------------------------------------------------- bad inputs


def good() -> dict[str, object]:
    return dict(
        mask=torch.ones(2, 4, 4),
        partner=torch.tensor([1, 0]),
        labels=torch.tensor([0, 1]),
        num_classes=3,
    )


BAD = [
    ("mask/label batch mismatch", dict(labels=torch.tensor([0, 1, 2])), "batch size"),
    ("partner batch mismatch", dict(partner=torch.tensor([1])), "partner has batch size"),
    ("labels out of range", dict(labels=torch.tensor([0, 3])), "out of range"),
    ("negative labels", dict(labels=torch.tensor([-1, 0])), "out of range"),
    ("negative weights", dict(mask=-torch.ones(2, 4, 4)), r"\[0, 1\]"),
    ("weights above one", dict(mask=2 * torch.ones(2, 4, 4)), r"\[0, 1\]"),
    ("NaN weights", dict(mask=torch.full((2, 4, 4), float("nan"))), "NaN"),
    ("integer mask", dict(mask=torch.ones(2, 4, 4, dtype=torch.long)), "float"),
    ("float partner", dict(partner=torch.tensor([1.0, 0.0])), "integer"),
    ("partner out of range", dict(partner=torch.tensor([2, 0])), "partner indices"),
    ("bool labels", dict(labels=torch.tensor([True, False])), "dtype"),
    ("2-d integer labels", dict(labels=torch.tensor([[0], [1]])), r"shape \(batch,\)"),
    ("soft labels of the wrong width", dict(labels=torch.ones(2, 4) / 4), "num_classes"),
    ("soft labels off the simplex", dict(labels=torch.ones(2, 3)), "sum to 1"),
    ("soft labels with NaN", dict(labels=torch.full((2, 3), float("nan"))), "NaN"),
    ("mask of the wrong rank", dict(mask=torch.ones(2, 4)), "shape"),
    ("mask with two channels", dict(mask=torch.ones(2, 2, 4, 4)), "one channel"),
    ("smoothing of one", dict(label_smoothing=1.0), "label_smoothing"),
    ("negative smoothing", dict(label_smoothing=-0.1), "label_smoothing"),
    ("zero classes", dict(num_classes=0), "num_classes"),
    ("mask cells that do not tile the image", dict(image_size=(10, 10)), "tile the image"),
]


@pytest.mark.parametrize("name,override,match", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_are_refused_clearly(name: str, override: dict[str, object], match: str) -> None:
    kwargs = good() | override
    with pytest.raises(ValueError, match=match):
        TokenLabelMap.from_mask(**kwargs)  # type: ignore[arg-type]


def test_grid_that_does_not_divide_the_image_is_refused() -> None:
    lm = TokenLabelMap.from_mask(**good())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not divide the image"):
        lm.token_weights((3, 3))


def test_weights_of_the_wrong_shape_are_refused() -> None:
    lm = TokenLabelMap.from_mask(**good())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k=2"):
        lm.targets(torch.ones(2, 5, 3))


def test_direct_construction_checks_dtypes_and_shapes() -> None:
    with pytest.raises(ValueError, match="float32"):
        TokenLabelMap(
            sources=torch.zeros(2, 1, dtype=torch.long),
            mask=CellMask(torch.ones(2, 1, 1, 1, dtype=torch.float16)),
            image_weights=torch.ones(2, 1),
            labels=torch.zeros(2, dtype=torch.long),
            num_classes=2,
            image_size=(4, 4),
        )
    with pytest.raises(ValueError, match=r"wrap .* as CellMask\(weights\)"):
        TokenLabelMap(
            sources=torch.zeros(2, 1, dtype=torch.long),
            mask=torch.ones(2, 1, 1, 1),  # type: ignore[arg-type]  # a bare tensor, as a user might pass
            image_weights=torch.ones(2, 1),
            labels=torch.zeros(2, dtype=torch.long),
            num_classes=2,
            image_size=(4, 4),
        )
    with pytest.raises(ValueError, match="sources"):
        TokenLabelMap(
            sources=torch.zeros(2, 1),
            mask=CellMask(torch.ones(2, 1, 1, 1)),
            image_weights=torch.ones(2, 1),
            labels=torch.zeros(2, dtype=torch.long),
            num_classes=2,
            image_size=(4, 4),
        )


def test_check_catches_weights_that_do_not_sum_to_one() -> None:
    lm = TokenLabelMap(
        sources=torch.zeros(1, 2, dtype=torch.long),
        mask=CellMask(torch.full((1, 2, 1, 1), 0.3)),
        image_weights=torch.full((1, 2), 0.5),
        labels=torch.zeros(1, dtype=torch.long),
        num_classes=2,
        image_size=(4, 4),
    )
    with pytest.raises(ValueError, match="sum to 1 over the sources"):
        lm.check()


@pytest.mark.parametrize("tokens", [(14, 14), (56, 56), (7, 7), (224, 224)])
def test_box_token_weights_at_imagenet_size_are_the_cells_and_build_none(tokens: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Box/token overlaps give the dense cells' token weights bit for bit, without building cells."""
    gen = torch.Generator().manual_seed(0)
    corners = torch.randint(0, 225, (64, 4), generator=gen)
    boxes = torch.stack([corners[:, :2].min(1).values, corners[:, :2].max(1).values, corners[:, 2:].min(1).values, corners[:, 2:].max(1).values], 1)
    lm = TokenLabelMap.from_boxes(boxes, (224, 224), torch.zeros(64, dtype=torch.long), torch.zeros(64, dtype=torch.long), 2)
    expected = CellMask(lm.mask.dense()).token_weights(tokens)

    def no_cells(self: BoxMask) -> torch.Tensor:
        raise AssertionError("token_weights built the cell mask")

    monkeypatch.setattr(BoxMask, "dense", no_cells)
    got = lm.token_weights(tokens)
    assert torch.equal(got, expected)
    assert (got[:, :, 1] > 0).any() and (got[:, :, 1] < 1).any()  # partial tokens exist: the test can fail


def test_mask_kinds_move_and_pin_as_themselves() -> None:
    lm = TokenLabelMap.from_boxes(torch.tensor([[0, 2, 1, 3]]), (4, 4), torch.tensor([0]), torch.tensor([1]), 3)
    moved = lm.to("cpu", non_blocking=True)
    assert isinstance(moved.mask, BoxMask) and torch.equal(moved.mask.boxes, lm.mask.boxes)
    cells = TokenLabelMap.from_mask(torch.ones(1, 4, 4), torch.tensor([0]), torch.tensor([1]), 3)
    assert isinstance(cells.mask, CellMask) and isinstance(cells.to("cpu", non_blocking=True).mask, CellMask)
    if torch.cuda.is_available():  # pinning needs an accelerator runtime
        pinned = lm.pin_memory()
        assert pinned.sources.is_pinned() and isinstance(pinned.mask, BoxMask) and pinned.mask.boxes.is_pinned()


@given(
    cells=st.tuples(st.integers(1, 12), st.integers(1, 12)), tokens=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    corners=st.lists(st.tuples(*[st.integers(-5, 17)] * 4), min_size=1, max_size=4),
)
def test_box_token_weights_equal_the_cells_bit_for_bit_on_any_grids_and_boxes_past_the_grid(
    cells: tuple[int, int], tokens: tuple[int, int], corners: list[tuple[int, int, int, int]]
) -> None:
    """``BoxMask.token_weights`` (box/token overlaps in lcm units, both axes at once, no clamp of the bounds) equals
    the dense cells' token weights bit for bit, whether or not the token grid divides the cells, for boxes
    reaching past the grid on any side (clipped, as ``BoxMask`` documents) and empty ones."""
    boxes = torch.tensor([(min(a, b), max(a, b), min(c, d), max(c, d)) for a, b, c, d in corners])
    mask = BoxMask(boxes, cells)
    assert torch.equal(mask.token_weights(tokens), CellMask(mask.dense()).token_weights(tokens))


@pytest.mark.parametrize(("cells", "tokens", "kernels"), [((224, 224), (14, 14), 6), ((224, 160), (14, 10), 6),
                                                          ((6, 9), (4, 6), 7), ((3, 5), (5, 3), 7)])
def test_box_token_weights_index_nothing_and_scale_only_where_a_cell_is_several_units(
    cells: tuple[int, int], tokens: tuple[int, int], kernels: int
) -> None:
    """The box bounds broadcast per axis against the tokens' spans (the shorter axis padded with empty spans), no
    indexing; they are scaled to the lcm grid only where a cell is several of its units (pixel cells with tokens
    that divide them: six computing operators, seven else), and every answer stays the cell mask's bit for bit."""
    from benchmarks._op_counter import OpCounter

    boxes = torch.tensor([[1, 4, 0, 3], [-2, 30, 2, 200], [3, 3, 1, 5], [0, cells[0], 0, cells[1]], [5, 2, 7, 1]])
    mask = BoxMask(boxes, cells)
    with OpCounter() as ops:
        got = mask.token_weights(tokens)
    assert "index" not in ops.ops and ops.kernels == kernels, ops.ops
    assert torch.equal(got, CellMask(mask.dense()).token_weights(tokens))
