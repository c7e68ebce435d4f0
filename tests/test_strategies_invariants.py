"""Property-based invariants of the mixers' outputs, checked against direct formulas.

Mixed pixels are the mask-weighted sources, the image weight is the mask mean,
cell mixers are cell-aligned and take the sampled number of cells, bf16 batches
keep class ids exact, and token weights on any dividing grid are exact area
fractions (measured on the pixels or from the boxes, not from the mask code).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable
from unittest import mock

import hypothesis.strategies as st
import torch
from hypothesis import assume, given
from torch import Tensor
from torch.testing import assert_close

import mixlabels.strategies._patch as patch_module
from mixlabels import TokenLabelMap
from mixlabels import BoxMask
from mixlabels.strategies import BlockwiseMix, BoxParams, CellParams, CutMix, MixToken, MixUp, RandomPatchMix
from mixlabels.strategies._base import blend_images, mix_images, paste_box, select_images
from mixlabels.strategies._transfer import pack, unpack
from test_strategies_kornia import CELL, KINDS, NC, H, W, batch, make, maps_equal

PAIR_KINDS = [k for k in KINDS if k != "switch"]
BINARY = ("cutmix", "cutmix_patch", "random_patch", "blockwise")
modes = st.sampled_from(["batch", "pair", "elem"])
pairings = st.sampled_from(["flip", "derangement"])
seeds = st.integers(0, 2**31 - 1)


def pixel_weight(mask0: Tensor, hh: int, ww: int) -> Tensor:
    """A ``(b, mh, mw)`` cell mask repeated up to ``(b, hh, ww)`` pixels."""
    return mask0.repeat_interleave(hh // mask0.shape[1], 1).repeat_interleave(ww // mask0.shape[2], 2)


def id_images(b: int, hh: int, ww: int) -> Tensor:
    """Channel 0 holds the sample's index, channel 1 random noise (distinct images)."""
    ids = torch.arange(b, dtype=torch.float32)[:, None, None, None].expand(b, 1, hh, ww)
    return torch.cat([ids, torch.rand(b, 1, hh, ww, generator=torch.Generator().manual_seed(b))], dim=1)


# ====================================================================== pixels
@given(st.sampled_from(KINDS), st.integers(1, 5), modes, pairings, st.sampled_from([0.5, 1.0]), seeds,
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_mixed_pixels_are_the_mask_weighted_sources(
    kind: str, b: int, mode: str, pairing: str, prob: float, seed: int, dtype: torch.dtype
) -> None:
    x, y = batch(b, seed=seed % 1000, dtype=dtype)
    mixer = make(kind, mode=mode, pairing=pairing, prob=prob)
    out, lm = mixer(x, y, generator=torch.Generator().manual_seed(seed))
    assert out.dtype == dtype
    if lm.token_space:  # MixToken: the backbone mixes; pixels are untouched
        assert out is x
        return
    partner = lm.sources[:, 1]
    w = pixel_weight(lm.mask.dense()[:, 0], H, W)[:, None]  # b 1 H W, fp32
    compute = torch.float32 if dtype == torch.bfloat16 else dtype
    xc = x.to(compute)
    direct = (w * xc + (1.0 - w) * xc[partner]).to(dtype)  # fp32 weights, one rounding for half types
    assert torch.equal(out, direct)
    if dtype == torch.bfloat16:  # mix_pixels works in the images' dtype: equal up to bf16 rounding
        assert_close(out.float(), lm.mix_pixels(x).float(), atol=1e-2, rtol=1e-2)
    else:
        assert torch.equal(out, lm.mix_pixels(x))
    if kind in BINARY:  # binary masks copy pixels: each is exactly its own or the partner's
        assert ((out == x) | (out == x[partner])).all()


# ====================================================================== image weights
@given(st.sampled_from(PAIR_KINDS), st.integers(1, 5), modes, pairings, st.sampled_from([0.5, 1.0]), seeds)
def test_image_weight_is_the_mask_mean_and_the_pixel_fraction(kind: str, b: int, mode: str, pairing: str, prob: float, seed: int) -> None:
    mixer = make(kind, mode=mode, pairing=pairing, prob=prob)
    x = id_images(b, H, W)
    out, lm = mixer(x, torch.arange(b), generator=torch.Generator().manual_seed(seed))
    lm.check()
    assert_close(lm.image_weights[:, 0], lm.mask.dense()[:, 0].mean((1, 2)), rtol=0, atol=1e-6)
    assert_close(lm.image_weights.sum(1), torch.ones(b), rtol=0, atol=1e-6)
    if kind in BINARY:  # measured on the pixels: the fraction still showing the sample's own id
        partner = lm.sources[:, 1]
        own = (out[:, 0] == torch.arange(b)[:, None, None]).float().mean((1, 2))
        own = torch.where(partner == torch.arange(b), torch.ones(b), own)
        assert_close(lm.image_weights[:, 0], own, rtol=0, atol=1e-6)
    if kind == "mixup":  # channel 0 = lam * own id + (1 - lam) * partner id, on every pixel
        ids = lm.image_weights[:, 0] * torch.arange(b) + lm.image_weights[:, 1] * lm.sources[:, 1].float()
        assert_close(out[:, 0], ids[:, None, None].expand(b, H, W), rtol=1e-6, atol=1e-5)


@given(st.sampled_from(PAIR_KINDS), st.integers(1, 6), modes, pairings, st.sampled_from([0.5, 1.0]), seeds)
def test_the_map_built_where_the_params_were_drawn_equals_the_constructors(
    kind: str, b: int, mode: str, pairing: str, prob: float, seed: int
) -> None:
    """The mixers build the map's sources, weights and mask from the params where they were drawn (the host)
    and send them in one copy: the map ``from_boxes`` or ``from_mask`` builds from the same params, bit for bit."""
    x, y = batch(b, seed=seed % 1000)
    mixer = make(kind, mode=mode, pairing=pairing, prob=prob, label_smoothing=0.1)
    _, lm = mixer(x, y, generator=torch.Generator().manual_seed(seed))
    params = mixer.last_params
    boxes = params.cell_boxes()
    if boxes is not None:
        ref = TokenLabelMap.from_boxes(boxes[0], boxes[1], params.partner, y, NC, 0.1, (H, W), lm.token_space)
    else:
        ref = TokenLabelMap.from_mask(params.source_weight(), params.partner, y, NC, 0.1, (H, W), lm.token_space)
    assert maps_equal(lm, ref) and type(lm.mask) is type(ref.mask) and lm.validated


@given(st.integers(1, 6), modes, pairings, st.sampled_from([0.5, 1.0]), seeds)
def test_mixup_leaves_out_the_select_only_when_no_sample_is_unmixed(b: int, mode: str, pairing: str, prob: float, seed: int) -> None:
    """Params drawn on the host say whether a sample keeps weight 1; the pixels equal the always-selecting mix."""
    x, y = batch(b, seed=seed % 1000)
    x[-1, 0, 0, 0] = float("nan")  # a partner's NaN must not reach an unmixed sample
    mixer = MixUp(NC, mode=mode, pairing=pairing, prob=prob)  # type: ignore[arg-type]
    out, _ = mixer(x, y, generator=torch.Generator().manual_seed(seed))
    params = mixer.last_params
    assert params is not None
    ref = mix_images(x, params.partner, params.source_weight())  # unmixed=None: selects wherever a weight is 1
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())


@given(st.integers(1, 6), st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
       st.sampled_from(["flip", "roll", "random"]), st.one_of(st.sampled_from([0.0, 1.0, 0.5]), st.floats(0.0, 1.0)),
       st.booleans(), seeds)
def test_blending_with_one_shared_weight_equals_the_per_sample_mix(
    b: int, dtype: torch.dtype, pairing: str, lam: float, channels_last: bool, seed: int
) -> None:
    """Batch-mode MixUp blends with two Python scalars: the pixels ``mix_images`` gives that weight in every sample,
    bit for bit, in every float dtype and memory format (a partner's NaN or inf included)."""
    lam = float(torch.tensor(lam, dtype=torch.float32))  # the fp32 value the sampler hands over
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 3, 4, 6, generator=g).to(dtype)
    x[0, 0, 0, 0], x[-1, 1, 1, 1] = float("nan"), float("inf")
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    idx = torch.arange(b)
    partner = {"flip": idx.flip(0), "roll": idx.roll(1), "random": torch.randperm(b, generator=g)}[pairing]
    out = blend_images(x, partner, lam)
    ref = mix_images(x, partner, torch.full((b, 1, 1), lam))
    assert out.dtype == x.dtype and out.shape == x.shape
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())
    if lam == 1.0:  # nothing mixed: the images themselves, a partner's NaN kept out
        assert torch.equal(out.nan_to_num(), x.nan_to_num()) and torch.equal(out.isnan(), x.isnan())


@given(st.integers(1, 7), st.sampled_from([0.5, 1.0]), seeds)
def test_batch_mode_mixup_hands_over_its_one_lambda_only_when_every_sample_shares_it(b: int, prob: float, seed: int) -> None:
    """``shared_lam`` is the lambda of every sample or absent (an odd flip batch's middle sample keeps weight 1), and a
    replaced ``lam`` drops it, with the other values derived from the draws."""
    params = MixUp(NC, prob=prob).sample((b, 3, H, W), generator=torch.Generator().manual_seed(seed))
    lams = set(params.lam.tolist())
    assert (params.shared_lam is not None) == (len(lams) == 1)
    if params.shared_lam is not None:
        assert lams == {params.shared_lam} and params.shared_weight() == params.shared_lam
    replaced = dataclasses.replace(params, lam=torch.full((b,), 0.25))
    assert replaced.shared_weight() is None and replaced.current().label_weights is None


def test_packed_params_come_back_with_their_dtypes_shapes_and_values() -> None:
    """``to_device`` sends params to CUDA as one buffer: its packing is checked here, where no GPU is needed."""
    tensors = [torch.tensor([True, False, True]), torch.arange(5), torch.rand(2, 3), torch.tensor(3.5, dtype=torch.float64),
               torch.empty(0, 4, dtype=torch.long), torch.tensor([1, -2], dtype=torch.int8), torch.arange(6).view(2, 3).t()]
    buffer = pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.numel() % 8 == 0
    for got, want in zip(unpack(buffer, tensors), tensors):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


@given(st.integers(1, 6), seeds)
def test_cutmix_uncorrected_lambda_is_the_draw_and_clipping_only_shrinks_boxes(b: int, seed: int) -> None:
    x, y = batch(2 * b, 12, 12, seed=1)
    for correct in (True, False):
        mixer = CutMix(10, correct_lam=correct, mode="elem")
        _, lm = mixer(x, y, generator=torch.Generator().manual_seed(seed))
        params = mixer.last_params
        assert isinstance(params, BoxParams)
        area_lam = lm.mask.dense()[:, 0].mean((1, 2))
        assert_close(params.image_weight(), lm.image_weights[:, 0], rtol=0, atol=1e-6)  # the params' own lambda
        if correct:
            assert_close(lm.image_weights[:, 0], area_lam, rtol=0, atol=1e-6)
        else:  # timm's legacy: the label keeps the drawn lambda, not the pasted area
            assert torch.equal(lm.image_weights[:, 0], params.lam)
        # The side is floored and the box clipped, so the pasted area never exceeds 1 - lam.
        assert (area_lam >= params.lam - 1e-6).all()


@given(st.sampled_from(["cutmix", "cutmix_patch", "mixtoken"]), st.integers(1, 6), modes, pairings,
       st.sampled_from([0.5, 1.0]), st.booleans(), seeds)
def test_box_maps_keep_boxes_and_equal_the_dense_cell_map(
    kind: str, b: int, mode: str, pairing: str, prob: float, correct_lam: bool, seed: int
) -> None:
    """Box mixers store boxes, not cells, and every weight equals the dense map of the params' mask, bit for bit."""
    x, y = batch(b, seed=seed % 1000)
    mixer = make(kind, mode=mode, pairing=pairing, prob=prob, label_smoothing=0.1)
    if kind == "cutmix" and not correct_lam:
        kw: dict[str, Any] = dict(mode=mode, pairing=pairing, prob=prob, label_smoothing=0.1)
        mixer = CutMix(10, correct_lam=False, **kw)
    _, lm = mixer(x, y, generator=torch.Generator().manual_seed(seed))
    params = mixer.last_params
    assert isinstance(params, BoxParams) and isinstance(lm.mask, BoxMask)
    dense = TokenLabelMap.from_mask(params.source_weight(), params.partner, y, 10, 0.1, (H, W), lm.token_space)
    assert torch.equal(lm.mask.dense(), dense.mask.dense()) and torch.equal(lm.sources, dense.sources)
    if params.lambda_is_mask_mean:
        assert torch.equal(lm.image_weights, dense.image_weights)
        assert torch.equal(lm.image_targets(), dense.image_targets())
    else:  # timm's legacy lambda: the draw, not the area
        assert torch.equal(lm.image_weights[:, 0], params.lam)
    for grid in ((H // CELL, W // CELL), (2, 3), (H, W)):
        assert torch.equal(lm.token_weights(grid), dense.token_weights(grid))


@given(st.integers(1, 6), st.integers(0, H), st.integers(0, H), st.integers(0, W), st.integers(0, W), seeds)
def test_paste_box_copies_equal_the_batched_gather_and_the_select(b: int, y0: int, y1: int, x0: int, x1: int, seed: int) -> None:
    """The per-sample copies (CPU, no autograd) equal the batched gather (autograd) and the select, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(b, 3, H, W, generator=gen, dtype=torch.float64)
    partner = torch.randint(0, b, (b,), generator=gen)  # self-pairs included
    before = x.clone()
    out = paste_box(x, partner, (y0, y1, x0, x1))
    keep = torch.ones(b, H, W, dtype=torch.bool)
    keep[:, y0:y1, x0:x1] = False
    assert torch.equal(out, select_images(x, partner, keep)) and torch.equal(x, before)  # pure
    with torch.enable_grad():
        batched = paste_box(x.clone().requires_grad_(True), partner, (y0, y1, x0, x1))
    assert torch.equal(out, batched.detach())


# ====================================================================== cell mixers
class BetaRecorder:
    """Wraps ``draw_beta`` in the patch module and keeps every lambda it returned (one a group, in order)."""

    def __init__(self) -> None:
        self.draws: list[float] = []
        self._real: Callable[..., float] = patch_module.draw_beta

    def __call__(self, *args: Any, **kwargs: Any) -> float:
        lam = self._real(*args, **kwargs)
        self.draws.append(lam)
        return lam

    def lambdas(self) -> Tensor:
        """The lambdas as the params keep them: fp32."""
        return torch.tensor(self.draws, dtype=torch.float64).float()


@given(st.sampled_from(["random_patch", "blockwise"]), st.sampled_from([2, 4]), st.integers(1, 5), st.integers(1, 5),
       st.integers(1, 5), pairings, st.sampled_from([0.3, 1.0, 4.0]), seeds)
def test_cell_mixers_are_cell_aligned_and_take_the_sampled_count(
    kind: str, cell: int, gh: int, gw: int, b: int, pairing: str, alpha: float, seed: int
) -> None:
    # a block is strictly smaller than the grid: a grid one cell high or wide has no block (refused)
    assume(kind != "blockwise" or (gh > 1 and gw > 1))
    hh, ww, n = gh * cell, gw * cell, gh * gw
    cls = RandomPatchMix if kind == "random_patch" else BlockwiseMix
    kw: dict[str, Any] = {"min_cells": 1} if kind == "blockwise" else {}
    mixer = cls(10, cell_size=cell, alpha=alpha, mode="elem", pairing=pairing, **kw)  # type: ignore[arg-type]
    x = torch.rand(b, 2, hh, ww, generator=torch.Generator().manual_seed(seed % 997))
    recorder = BetaRecorder()
    with mock.patch.object(patch_module, "draw_beta", recorder):
        out, lm = mixer(x, torch.zeros(b, dtype=torch.long), generator=torch.Generator().manual_seed(seed))
    params = mixer.last_params
    assert isinstance(params, CellParams) and len(recorder.draws) == b  # elem mode: one draw a sample
    lam = recorder.lambdas()
    partner = lm.sources[:, 1]
    # Cell-aligned: every cell of the output is entirely the sample's own block or entirely the partner's.
    cells_out = out.unflatten(2, (gh, cell)).unflatten(4, (gw, cell))  # b c gh ph gw pw
    own = (cells_out == x.unflatten(2, (gh, cell)).unflatten(4, (gw, cell))).all(dim=(1, 3, 5))
    theirs = (cells_out == x[partner].unflatten(2, (gh, cell)).unflatten(4, (gw, cell))).all(dim=(1, 3, 5))
    assert (own | theirs).all()
    applied = params.applied
    assert torch.equal(~own & applied[:, None, None], params.cells)  # random images: own == partner's never by chance
    assert torch.equal(lm.mask.dense()[:, 1] == 1, params.cells) and lm.mask.dense().shape[2:] == (gh, gw)
    # The ratio: floor((1 - lam) n) cells for the sample's own draw (elem mode: draw i for sample i).
    target = torch.floor((1.0 - lam.double()) * n).long()
    count = params.cells.sum((1, 2))
    if kind == "random_patch":
        assert torch.equal(count[applied], target[applied])
        assert ((count[applied] / n - (1 - lam[applied].double())).abs() < 1 / n + 1e-9).all()
    else:  # BEiT's generator may give up a few cells short, never over
        assert (count[applied] <= target[applied]).all()
    assert (count[~applied] == 0).all()
    assert_close(lm.image_weights[:, 0], 1 - count.float() / n, rtol=0, atol=1e-6)


# ====================================================================== bf16 ids
@given(st.sampled_from(KINDS), st.integers(2, 5), modes, pairings, st.sampled_from([0.0, 0.1]), seeds)
def test_bf16_batch_keeps_class_ids_exact(kind: str, b: int, mode: str, pairing: str, smoothing: float, seed: int) -> None:
    nc = 1000
    ids = torch.tensor([257, 999, 256, 511, 300])[:b]  # not representable in bf16 (spacing 2 above 256, 4 above 512)
    assert not torch.equal(ids.to(torch.bfloat16).long(), ids)
    x = torch.rand(b, 3, H, W, generator=torch.Generator().manual_seed(seed % 991)).to(torch.bfloat16)
    mixer = make(kind, mode=mode, pairing=pairing, label_smoothing=smoothing, num_classes=nc)
    out, lm = mixer(x, ids, generator=torch.Generator().manual_seed(seed))
    assert out.dtype == torch.bfloat16 and torch.equal(lm.labels, ids)
    targets = lm.image_targets()
    assert targets.dtype == torch.float32
    w0, w1 = lm.image_weights[:, 0], lm.image_weights[:, 1]
    partner = lm.sources[:, 1]
    off = smoothing / nc
    expected = torch.full((b, nc), off)
    rows = torch.arange(b)
    expected[rows, ids] += w0 * (1 - smoothing)
    expected[rows, ids[partner]] += w1 * (1 - smoothing)
    assert_close(targets, expected, rtol=0, atol=1e-6)
    if smoothing == 0.0:  # mass exactly at the ids, nowhere else
        assert torch.equal(targets[rows, ids], torch.where(partner == rows, torch.ones(b), w0))
        assert torch.equal(targets[rows, ids[partner]], torch.where(partner == rows, torch.ones(b), w1))
        keep = torch.zeros(b, nc, dtype=torch.bool)
        keep[rows, ids] = True
        keep[rows, ids[partner]] = True
        assert (targets[~keep] == 0).all()


# ====================================================================== token weights
@given(st.sampled_from([8, 12, 16, 24]), st.sampled_from([8, 12, 16, 24]), st.integers(1, 4), modes, seeds, st.data())
def test_token_weights_of_boxes_are_exact_area_fractions(hh: int, ww: int, b: int, mode: str, seed: int, data: st.DataObject) -> None:
    """CutMix (free or snapped) and MixToken: the partner's share of a token is the box's overlap with it."""
    cell = data.draw(st.sampled_from([c for c in (None, 2, 4) if c is None or (hh % c == 0 and ww % c == 0)]))
    token = data.draw(st.sampled_from([c for c in (None, 2, 4) if c is not None and hh % c == 0 and ww % c == 0]))
    mixer: CutMix | MixToken = MixToken(10, patch_size=token, mode=mode) if cell is None and seed % 2 else CutMix(10, patch_size=cell, mode=mode)  # type: ignore[arg-type]
    _, lm = mixer(torch.rand(b, 1, hh, ww), torch.zeros(b, dtype=torch.long), generator=torch.Generator().manual_seed(seed))
    params = mixer.last_params
    assert isinstance(params, BoxParams)
    scale = hh // params.grid[0]  # pixels per box unit
    for gh in [d for d in range(1, hh + 1) if hh % d == 0][::2]:
        for gw in [d for d in range(1, ww + 1) if ww % d == 0][::3]:
            got = lm.token_weights((gh, gw))
            ph, pw = hh // gh, ww // gw
            for i, (y0, y1, x0, x1) in enumerate((params.boxes * scale).tolist()):
                for r in range(gh):
                    oy = max(0, min(y1, (r + 1) * ph) - max(y0, r * ph))
                    for c in range(gw):
                        ox = max(0, min(x1, (c + 1) * pw) - max(x0, c * pw))
                        assert math.isclose(got[i, r * gw + c, 1].item(), oy * ox / (ph * pw), abs_tol=1e-6)


@given(st.sampled_from(["random_patch", "blockwise", "mixup"]), st.sampled_from([(8, 12), (12, 12), (16, 8)]), st.integers(1, 4), seeds, st.data())
def test_token_weights_of_cells_are_measured_pixel_fractions(kind: str, size: tuple[int, int], b: int, seed: int, data: st.DataObject) -> None:
    """On any dividing grid (cells straddling tokens included) the weight is the share of partner pixels."""
    hh, ww = size
    mixer: MixUp | RandomPatchMix | BlockwiseMix
    if kind == "mixup":
        mixer = MixUp(10, mode="elem", pairing="derangement")
    elif kind == "random_patch":
        mixer = RandomPatchMix(10, cell_size=4, mode="elem", pairing="derangement")
    else:
        mixer = BlockwiseMix(10, cell_size=4, min_cells=2, mode="elem", pairing="derangement")
    x = id_images(b, hh, ww)
    out, lm = mixer(x, torch.zeros(b, dtype=torch.long), generator=torch.Generator().manual_seed(seed))
    gh = data.draw(st.sampled_from([d for d in range(1, hh + 1) if hh % d == 0]))
    gw = data.draw(st.sampled_from([d for d in range(1, ww + 1) if ww % d == 0]))
    partner = lm.sources[:, 1].float()
    own = torch.arange(b, dtype=torch.float32)
    if kind == "mixup":  # channel 0 is lam * own + (1 - lam) * partner: read the partner's share off it
        gap = torch.where(partner == own, 1.0, partner - own)  # a sample alone keeps share 0
        share = (out[:, 0] - own[:, None, None]) / gap[:, None, None]
        tol = 1e-5
    else:  # a pixel whose id is not the sample's own came from the partner
        share = (out[:, 0] != own[:, None, None]).float()
        tol = 1e-6
    ref = share.unflatten(1, (gh, hh // gh)).unflatten(3, (gw, ww // gw)).mean(dim=(2, 4)).flatten(1)  # b (gh gw)
    assert_close(lm.token_weights((gh, gw))[..., 1], ref, rtol=0, atol=tol)


# ====================================================================== MixToken
@given(st.integers(1, 5), modes, pairings, seeds)
def test_mixtoken_box_on_token_grid_mixes_like_snapped_cutmix(b: int, mode: str, pairing: str, seed: int) -> None:
    """Mixing patch embeddings with the map equals embedding the CutMix image with the same box."""
    ps = 4
    x, y = batch(b, seed=seed % 991)
    mixer = MixToken(10, patch_size=ps, mode=mode, pairing=pairing)  # type: ignore[arg-type]
    out, lm = mixer(x, y, generator=torch.Generator().manual_seed(seed))
    params = mixer.last_params
    assert isinstance(params, BoxParams)
    gh, gw = H // ps, W // ps
    assert out is x and lm.token_space and params.token_space and params.grid == (gh, gw)
    assert lm.mask.dense().shape == (b, 2, gh, gw) and set(lm.mask.dense().unique().tolist()) <= {0.0, 1.0}
    boxes = params.boxes
    assert ((boxes[:, 0] >= 0) & (boxes[:, 0] <= boxes[:, 1]) & (boxes[:, 1] <= gh)).all()
    assert ((boxes[:, 2] >= 0) & (boxes[:, 2] <= boxes[:, 3]) & (boxes[:, 3] <= gw)).all()
    for i, (y0, y1, x0, x1) in enumerate(boxes.tolist()):
        want = torch.zeros(gh, gw)
        want[y0:y1, x0:x1] = 1.0
        assert torch.equal(lm.mask.dense()[i, 1], want)
        assert math.isclose(lm.image_weights[i, 0].item(), 1 - (y1 - y0) * (x1 - x0) / (gh * gw), abs_tol=1e-6)
    embed = torch.nn.Conv2d(3, 8, ps, stride=ps)
    with torch.no_grad():
        tokens = embed(x).flatten(2).transpose(1, 2)  # b n d
        pixel_params = BoxParams(partner=params.partner, applied=params.applied, image_size=params.image_size,
                                 boxes=params.boxes, lam=params.lam, grid=params.grid)
        cut, _ = CutMix(10, patch_size=ps).mix(x, y, pixel_params)
        assert_close(lm.mix_tokens(tokens, (gh, gw)), embed(cut).flatten(2).transpose(1, 2))
