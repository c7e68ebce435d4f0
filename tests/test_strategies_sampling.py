"""The random side of the mixers: lambda's distribution, box coverage, generators, replay, Switch.

Statistical tests use large batches of tiny images and fixed generators, so they
are deterministic; each also shows it can fail (a negative control).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import timm.data.mixup as timm_mixup
import torch
from scipy import stats
from torch import Tensor
from torch.testing import assert_close

from mixlabels.strategies import BoxParams, CutMix, MixParams, MixUp, MixUpParams, RandomPatchMix, Switch, SwitchParams
from mixlabels.strategies._host_draws import host_rng
from mixlabels.strategies._sampling import sample_beta
from test_strategies_kornia import CELL, KINDS, NC, H, W, batch, make, maps_equal


def params_equal(a: Any, b: Any) -> bool:
    """Field-by-field equality of two params values (tensors compared exactly)."""
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        if f.name == "drawn_from":
            continue  # provenance (the very objects the derived values came from), not a draw
        va, vb = getattr(a, f.name), getattr(b, f.name)
        same = params_equal(va, vb) if dataclasses.is_dataclass(va) else (torch.equal(va, vb) if isinstance(va, Tensor) else va == vb)
        if not same:
            return False
    return True


def within_binomial(count: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


# ====================================================================== lambda ~ Beta(alpha)
@pytest.mark.parametrize("alpha", [0.2, 0.8, 1.0, 3.0])
@pytest.mark.parametrize("cls", [MixUp, CutMix])
def test_lambda_follows_beta_alpha(cls: type[MixUp] | type[CutMix], alpha: float) -> None:
    n = 4000  # elem mode, even batch, flip pairing: every sample mixed with its own draw
    mixer = cls(NC, alpha=alpha, mode="elem")
    params = mixer.sample((n, 1, 4, 4), generator=torch.Generator().manual_seed(int(alpha * 10)))
    assert isinstance(params, (MixUpParams, BoxParams)) and bool(params.applied.all())
    lam = params.lam.double().numpy()
    assert stats.kstest(lam, stats.beta(alpha, alpha).cdf).pvalue > 1e-3
    # Negative control: the same sample rejects a clearly different concentration.
    for other in (alpha / 3, alpha * 3):
        assert stats.kstest(lam, stats.beta(other, other).cdf).pvalue < 1e-6


def test_sample_beta_small_alpha_reaches_both_ends() -> None:
    # Lambdas are fp32: for alpha = 0.05 a fifth of the mass lies within 1e-7 of 1 and rounds to 1.0,
    # so compare the CDF at thresholds far from fp32's resolution instead of a KS test.
    n, alpha = 4000, 0.05
    lam = sample_beta(alpha, n, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert torch.isfinite(lam).all() and (lam >= 0).all() and (lam <= 1).all()
    for t in (1e-6, 1e-3, 0.1, 0.5, 0.9, 1 - 1e-3):
        assert within_binomial(int((lam < t).sum()), n, float(stats.beta(alpha, alpha).cdf(t)))


def test_pair_mode_draws_once_per_pair() -> None:
    n = 4000
    params = MixUp(NC, alpha=0.5, mode="pair").sample((n, 1, 1, 1), generator=torch.Generator().manual_seed(0))
    assert torch.equal(params.lam, params.lam.flip(0))  # pair i and b-1-i share a lambda
    assert stats.kstest(params.lam[: n // 2].double().numpy(), stats.beta(0.5, 0.5).cdf).pvalue > 1e-3
    batch_lam = MixUp(NC, mode="batch").sample((n, 1, 1, 1), generator=torch.Generator().manual_seed(0)).lam
    assert (batch_lam == batch_lam[0]).all()


def test_random_patch_count_follows_beta() -> None:
    # floor((1 - lam) * n) cells, lam ~ Beta(2, 2): the partner fraction is Beta(2, 2) up to one cell.
    params = RandomPatchMix(NC, cell_size=1, alpha=2.0, mode="elem").sample((4000, 1, 16, 16), generator=torch.Generator().manual_seed(0))
    frac = params.cells.float().mean((1, 2)).double().numpy() + 0.5 / 256  # centre of the floored bin
    assert stats.kstest(frac, stats.beta(2, 2).cdf).pvalue > 1e-3
    assert stats.kstest(frac, stats.beta(1, 1).cdf).pvalue < 1e-6


# ====================================================================== boxes cover the image
def coverage(boxes: Tensor, grid: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    """Rows, columns and cells some non-empty box covers, and how many boxes touch each edge (top, bottom, left, right)."""
    y0, y1, x0, x1 = boxes.unbind(1)
    nonempty = (y1 > y0) & (x1 > x0)
    rows = torch.arange(grid[0])[None]
    cols = torch.arange(grid[1])[None]
    in_rows = (rows >= y0[:, None]) & (rows < y1[:, None]) & nonempty[:, None]
    in_cols = (cols >= x0[:, None]) & (cols < x1[:, None]) & nonempty[:, None]
    cells = (in_rows[:, :, None] & in_cols[:, None, :]).any(0)
    edges = [int((e & nonempty).sum()) for e in (y0 == 0, y1 == grid[0], x0 == 0, x1 == grid[1])]
    return in_rows.any(0), in_cols.any(0), cells, edges


@pytest.mark.parametrize(("kind", "grid"), [("cutmix", (H, W)), ("cutmix_patch", (H // CELL, W // CELL)), ("mixtoken", (H // CELL, W // CELL)), ("minmax", (H, W))])
def test_boxes_cover_the_whole_image_and_touch_every_edge(kind: str, grid: tuple[int, int]) -> None:
    mixer = CutMix(NC, minmax=(0.2, 0.6), mode="elem") if kind == "minmax" else make(kind, mode="elem")
    params = mixer.sample((2000, 1, H, W), generator=torch.Generator().manual_seed(0))
    assert isinstance(params, BoxParams) and params.grid == grid
    rows, cols, cells, edges = coverage(params.boxes, grid)
    assert rows.all() and cols.all() and cells.all()  # every row, column and pixel (cell) is pasted over
    assert min(edges) > 20  # boxes touching the top, bottom, left and right edges all occur
    inside = params.source_weight() == 0
    for i in range(50):  # the mask is exactly the box
        assert torch.equal(inside[i], coverage(params.boxes[i : i + 1], grid)[2])


def test_box_positions_cover_rows_and_columns_as_timm_does() -> None:
    """Per-row and per-column coverage frequencies of free CutMix boxes equal timm's ``rand_bbox``
    (numpy, same Beta(1, 1) lambda) within 5 standard errors: the centres span the whole image."""
    n = 10000
    np.random.seed(0)  # timm draws with numpy's global RNG
    theirs = torch.tensor([timm_mixup.rand_bbox((H, W), lam) for lam in np.random.beta(1.0, 1.0, size=n)])
    ours = CutMix(NC, mode="elem").sample((n, 1, H, W), generator=torch.Generator().manual_seed(0)).boxes
    for f_ours, f_timm in zip(coverage_frequency(ours, (H, W)), coverage_frequency(theirs, (H, W))):
        se = torch.sqrt(2 * f_timm * (1 - f_timm) / n).clamp(min=1e-3)
        assert ((f_ours - f_timm).abs() < 5 * se).all(), (f_ours, f_timm)


def coverage_frequency(boxes: Tensor, grid: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Fraction of boxes covering each row and each column (empty boxes cover nothing)."""
    y0, y1, x0, x1 = boxes.unbind(1)
    nonempty = ((y1 > y0) & (x1 > x0))[:, None]
    rows = torch.arange(grid[0])[None]
    cols = torch.arange(grid[1])[None]
    row_f = ((rows >= y0[:, None]) & (rows < y1[:, None]) & nonempty).double().mean(0)
    col_f = ((cols >= x0[:, None]) & (cols < x1[:, None]) & nonempty).double().mean(0)
    return row_f, col_f


def test_coverage_catches_boxes_that_never_reach_an_edge() -> None:
    """Negative control: old timm's ``rand_bbox_minmax`` drew the corner with ``randint(0, H - cut)``
    (upper bound excluded), so boxes never touched the bottom or right edge; the coverage check sees it."""
    g = torch.Generator().manual_seed(0)
    n = 2000
    cut_h = torch.randint(int(H * 0.2), int(H * 0.6), (n,), generator=g)
    cut_w = torch.randint(int(W * 0.2), int(W * 0.6), (n,), generator=g)
    y0 = (torch.rand(n, generator=g, dtype=torch.float64) * (H - cut_h)).long()
    x0 = (torch.rand(n, generator=g, dtype=torch.float64) * (W - cut_w)).long()
    rows, cols, cells, edges = coverage(torch.stack([y0, y0 + cut_h, x0, x0 + cut_w], 1), (H, W))
    assert edges[1] == 0 and edges[3] == 0 and not rows[-1] and not cols[-1]


# ====================================================================== generator
@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_params_and_masks_other_seed_other(kind: str) -> None:
    x, y = batch(6)
    outs = []
    for seed in (3, 3, 4):
        mixer = make(kind, mode="elem", pairing="derangement", prob=0.7, seed=seed)
        state = torch.random.get_rng_state()
        mixed, lm = mixer(x, y)
        assert torch.equal(torch.random.get_rng_state(), state)  # the explicit generator, never the global RNG
        outs.append((mixer.last_params, mixed, lm))
    (p1, m1, l1), (p2, m2, l2), (p3, m3, l3) = outs
    assert params_equal(p1, p2) and torch.equal(m1, m2) and maps_equal(l1, l2)
    assert not params_equal(p1, p3) and not maps_equal(l1, l3)


@pytest.mark.parametrize("kind", KINDS)
def test_params_replay_reproduces_the_output(kind: str) -> None:
    x, y = batch(5)
    mixer = make(kind, mode="pair", pairing="derangement")
    mixed, lm = mixer(x, y, generator=torch.Generator().manual_seed(11))
    params = mixer.last_params
    recorded = mixer._params  # kornia's dict, as AugmentationSequential records it
    again = make(kind, mode="pair", pairing="derangement")  # another instance, global RNG untouched
    for p in (params, recorded):
        replay, replay_lm = again(x, y, params=p)
        assert torch.equal(replay, mixed) and maps_equal(replay_lm, lm)
    pure, pure_lm = again.mix(x, y, params)
    assert torch.equal(pure, mixed) and maps_equal(pure_lm, lm)
    assert maps_equal(mixer.label_map(y), lm) and maps_equal(again.label_map(y, recorded), lm)


@pytest.mark.parametrize("kind", KINDS)
def test_params_move_with_to(kind: str) -> None:
    x, y = batch(4)
    mixer = make(kind, mode="elem")
    params = mixer.sample(x.shape, generator=torch.Generator().manual_seed(0))
    moved = params.to("meta")
    inner, inner_moved = (params.params, moved.params) if isinstance(params, SwitchParams) else (params, moved)
    assert type(moved) is type(params) and isinstance(inner_moved, MixParams)
    for f in dataclasses.fields(inner):
        value = getattr(inner_moved, f.name)
        if f.name == "drawn_from":  # provenance: the moved draws themselves
            assert value is None or all(a is b for a, b in zip(value, inner_moved._draws()))
        elif isinstance(getattr(inner, f.name), Tensor):
            assert value.device.type == "meta" and value.shape == getattr(inner, f.name).shape
        else:
            assert value == getattr(inner, f.name)
    back = params.to("cpu")
    assert params_equal(back, params)
    assert torch.equal(mixer.mix(x, y, back)[0], mixer.mix(x, y, params)[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_params_on_gpu_mix_like_cpu(kind: str) -> None:
    x, y = batch(4)
    mixer = make(kind, mode="elem")
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = mixer.sample(x.shape, generator=gen)
    inner = params.params if isinstance(params, SwitchParams) else params
    assert inner.partner.device.type == "cuda"  # drawn on the generator's device
    out, lm = mixer.mix(x.cuda(), y.cuda(), params)
    cpu_out, cpu_lm = mixer.mix(x, y, params.to("cpu"))
    assert_close(out.cpu(), cpu_out)
    for name in ("sources", "image_weights", "labels"):
        assert_close(getattr(lm, name).cpu(), getattr(cpu_lm, name))
    assert type(lm.mask) is type(cpu_lm.mask)  # a mask is no tensor: its cells compare, and the token weights
    assert_close(lm.mask.dense().cpu(), cpu_lm.mask.dense())
    assert_close(lm.token_weights((H // CELL, W // CELL)).cpu(), cpu_lm.token_weights((H // CELL, W // CELL)))


# ====================================================================== Switch
def test_switch_draws_each_mixer_with_its_probability() -> None:
    switch = Switch([MixUp(NC), CutMix(NC), RandomPatchMix(NC, cell_size=CELL)], probs=[1.0, 3.0, 6.0])
    assert switch.probs == pytest.approx((0.1, 0.3, 0.6))
    gen = torch.Generator().manual_seed(0)
    n = 600
    choices = [switch.sample((2, 1, H, W), generator=gen).choice for _ in range(n)]
    counts = [choices.count(i) for i in range(3)]
    for count, p in zip(counts, switch.probs):
        assert within_binomial(count, n, p)
    assert not within_binomial(counts[0], n, 1 / 3)  # negative control: not uniform
    # Each choice draws its own mixer's kind of params.
    typed = {(s.choice, type(s.params).__name__) for s in (switch.sample((2, 1, H, W), generator=gen) for _ in range(60))}
    assert typed == {(0, "MixUpParams"), (1, "BoxParams"), (2, "CellParams")}


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_switch_prob_zero_leaves_batches_unmixed(mode: str, smoothing: float) -> None:
    kw: dict[str, Any] = dict(prob=0.0, mode=mode, label_smoothing=smoothing)
    switch = Switch([MixUp(NC, **kw), CutMix(NC, **kw), RandomPatchMix(NC, cell_size=CELL, **kw)], generator=torch.Generator().manual_seed(0))
    x, y = batch(5)
    on, off = 1.0 - smoothing + smoothing / NC, smoothing / NC
    expected = torch.full((5, NC), off)
    expected[torch.arange(5), y] = on
    for _ in range(6):
        mixed, lm = switch(x, y)
        assert torch.equal(mixed, x)
        assert torch.equal(lm.image_targets(), expected)
        assert (lm.image_weights[:, 0] == 1).all() and (lm.mask.dense()[:, 0] == 1).all()


def test_switch_per_sample_prob_in_elem_mode() -> None:
    kw: dict[str, Any] = dict(prob=0.3, mode="elem")
    switch = Switch([MixUp(NC, **kw), CutMix(NC, **kw)], generator=torch.Generator().manual_seed(0))
    n = 2000
    x = torch.rand(n, 1, 4, 4)
    y = torch.arange(n) % NC
    for _ in range(2):
        mixed, lm = switch(x, y)
        assert switch.last_params is not None
        applied = switch.last_params.params.applied
        assert within_binomial(int(applied.sum()), n, 0.3)
        assert not within_binomial(int(applied.sum()), n, 0.5)
        # Unmixed samples keep their pixels and their one-hot target exactly; mixed ones move.
        assert torch.equal(mixed[~applied], x[~applied])
        assert torch.equal(lm.image_targets()[~applied], torch.nn.functional.one_hot(y[~applied], NC).float())
        assert (lm.image_weights[applied, 0] < 1).float().mean() > 0.9


def test_batch_mode_prob_is_all_or_nothing_per_batch() -> None:
    mixer = CutMix(NC, prob=0.4, mode="batch")
    gen = torch.Generator().manual_seed(0)
    mixed_batches = 0
    n = 400
    for _ in range(n):
        applied = mixer.sample((4, 1, 8, 8), generator=gen).applied
        assert bool(applied.all()) or not bool(applied.any())
        mixed_batches += int(applied.all())
    assert within_binomial(mixed_batches, n, 0.4)



def _beit_blocks(target: int, grid: tuple[int, int], uniform: Any, min_cells: int,
                 log_aspect: tuple[float, float]) -> Tensor:
    """Our reading of BEiT's ``MaskingGenerator`` for one group, scalar by scalar, on uniforms from ``uniform()``.

    Each attempt: area uniform in ``[min_cells, remaining]``, log-uniform aspect, ``h, w`` rounded
    half to even (Python's ``round``); the block is drawn only if ``h < gh and w < gw`` (strictly
    smaller than the grid) and kept if it adds between 1 and ``remaining`` new cells; ten failed
    attempts in a row end the mask.
    """
    gh, gw = grid
    mask = torch.zeros(gh, gw, dtype=torch.bool)
    count, fails = 0, 0
    while count < target and fails < 10:
        u0, u1, u2, u3 = uniform(), uniform(), uniform(), uniform()
        remaining = target - count
        area = min_cells + u0 * (remaining - min_cells)
        aspect = math.exp(log_aspect[0] + u1 * (log_aspect[1] - log_aspect[0]))
        h, w = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        kept = False
        if h < gh and w < gw:
            top, left = math.floor(u2 * (gh - h + 1)), math.floor(u3 * (gw - w + 1))
            new = h * w - int(mask[top : top + h, left : left + w].sum())
            if 0 < new <= remaining:
                mask[top : top + h, left : left + w] = True
                count, kept = count + new, True
        fails = 0 if kept else fails + 1
    return mask


@pytest.mark.parametrize("seed", range(6))
def test_blockwise_blocks_follow_beit_and_stay_strictly_smaller_than_the_grid(seed: int) -> None:
    """Small grids and high targets: full-height or full-width blocks are drawn often and must be rejected."""
    from mixlabels.strategies._patch import BlockCellSampler

    grid, groups = (3, 4), 16
    sampler = BlockCellSampler(1, 1.0, None, 2, None, 0.3, None, "elem", "flip", 1.0)
    counts = torch.randint(4, 13, (groups,), generator=torch.Generator().manual_seed(100 + seed))
    got = sampler.cells_for(groups, grid, counts, torch.Generator().manual_seed(seed), torch.device("cpu"))
    # cells_for seeds one Python RNG from the generator; the groups take four uniforms an attempt, in turn
    replay = host_rng(torch.Generator().manual_seed(seed))
    for g in range(groups):
        want = _beit_blocks(int(counts[g]), grid, replay.random, 2, sampler.log_aspect)
        assert torch.equal(got[g], want), f"group {g}"


# ====================================================================== laws of the random mixers (issue 29)
# Each test below draws thousands of independent params with a fixed generator and compares how often each
# outcome comes with its probability under the mixer's definition (or BEiT's reference code): chi-square
# goodness of fit (or a two-sample chi-square) with the p-value threshold ALPHA_FALSE. A correct sampler fails
# a test with probability ALPHA_FALSE over the choice of seed (0.1%; with the fixed seeds here the tests are
# deterministic). Each law was also checked to fail with a planted bug (see the commit message).
ALPHA_FALSE = 1e-3


def beta_cdf(alpha: float) -> Any:
    return stats.beta(alpha, alpha).cdf


def chi_square_fit(observed: dict[Any, int], expected_p: dict[Any, float], n: int, min_expected: float = 5.0) -> float:
    """p-value of a chi-square goodness of fit; categories expected fewer than ``min_expected`` times are pooled.

    Every observed category must have positive probability under the law (else the law is plainly violated)."""
    stray = [k for k in observed if expected_p.get(k, 0.0) <= 0.0]
    assert not stray, f"outcomes impossible under the law: {stray[:5]}"
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k, p in expected_p.items():
        if n * p >= min_expected:
            obs.append(observed.get(k, 0))
            exp.append(n * p)
        else:
            pool_o, pool_e = pool_o + observed.get(k, 0), pool_e + n * p
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp_arr = np.array(exp) * (sum(obs) / sum(exp))  # the tiny mass of a measure-zero outcome, renormalised
    return float(stats.chisquare(obs, exp_arr).pvalue)


def tally(values: list[Any]) -> dict[Any, int]:
    out: dict[Any, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def floored_count_p(k: int, n: int, alpha: float) -> float:
    """P(floor((1 - lam) * n) = k), lam ~ Beta(alpha, alpha)."""
    f = beta_cdf(alpha)
    return float(f(1 - k / n) - f(1 - (k + 1) / n))


# ---------------------------------------------------------------------- CutMix: box sizes and positions
def cutmix_side_law(g: int, alpha: float) -> dict[tuple[int, int], float]:
    """Exact law of one axis ``(y0, y1)`` of a free CutMix box on ``g`` cells: side ``floor(g sqrt(1 - lam))``,
    centre uniform over the cells, ``[c - side // 2, c + (side + 1) // 2)`` clipped to the grid."""
    f = beta_cdf(alpha)
    law: dict[tuple[int, int], float] = {}
    for side in range(g + 1):
        p_side = float(f(1 - (side / g) ** 2) - f(1 - ((side + 1) / g) ** 2)) if side < g else 0.0
        for c in range(g):
            key = (min(max(c - side // 2, 0), g), min(max(c + (side + 1) // 2, 0), g))
            law[key] = law.get(key, 0.0) + p_side / g
    return law


@pytest.mark.parametrize("alpha", [1.0, 0.4])
@pytest.mark.parametrize("grid", [(8, 8), (6, 10)])
def test_cutmix_box_sides_and_positions_follow_their_definition(alpha: float, grid: tuple[int, int]) -> None:
    n = 8000
    boxes = CutMix(NC, alpha=alpha, mode="elem").sample((n, 1, *grid), generator=torch.Generator().manual_seed(3)).boxes
    for axis, g in ((0, grid[0]), (1, grid[1])):
        observed = tally([tuple(b) for b in boxes[:, 2 * axis : 2 * axis + 2].tolist()])
        assert chi_square_fit(observed, cutmix_side_law(g, alpha), n) > ALPHA_FALSE, axis


def test_cutmix_box_law_catches_timm_s_even_sides() -> None:
    """Negative control: timm's ``rand_bbox`` ends the box at ``c + side // 2`` (even sides only); our definition,
    ``c + (side + 1) // 2``, keeps the side drawn. The chi-square tells them apart."""
    n, g = 8000, 8
    np.random.seed(0)
    theirs = [timm_mixup.rand_bbox((g, g), lam) for lam in np.random.beta(1.0, 1.0, size=n)]
    observed = tally([(int(b[0]), int(b[2])) for b in theirs])
    assert chi_square_fit(observed, {**cutmix_side_law(g, 1.0), **{k: 1e-12 for k in observed}}, n) < 1e-6


def test_cutmix_minmax_sides_are_uniform_and_boxes_anywhere_inside() -> None:
    n, g, minmax = 8000, 10, (0.2, 0.7)
    boxes = CutMix(NC, minmax=minmax, mode="elem").sample((n, 1, g, g), generator=torch.Generator().manual_seed(4)).boxes
    lo, hi = int(g * minmax[0]), int(g * minmax[1])  # sides uniform in [lo, hi) (numpy's randint), as timm
    law = {(y0, y0 + s): 1 / (hi - lo) / (g - s + 1) for s in range(lo, hi) for y0 in range(g - s + 1)}
    for axis in (0, 1):
        observed = tally([tuple(b) for b in boxes[:, 2 * axis : 2 * axis + 2].tolist()])
        assert chi_square_fit(observed, law, n) > ALPHA_FALSE
    # the two sides are drawn independently (unlike free CutMix, where both follow lambda)
    sides = (boxes[:, 1] - boxes[:, 0]).tolist(), (boxes[:, 3] - boxes[:, 2]).tolist()
    joint = tally(list(zip(*sides)))
    assert chi_square_fit(joint, {(a, b): 1 / (hi - lo) ** 2 for a in range(lo, hi) for b in range(lo, hi)}, n) > ALPHA_FALSE


# ---------------------------------------------------------------------- GridMix: the cell size, the count, the cells
def test_gridmix_draws_each_cell_size_equally_and_floor_count_cells_uniformly() -> None:
    """Sizes 4 and 6 px on 12 px images (common grid of 2 px units, 6x6): a non-empty mask of size 4 is a union
    of aligned 2x2-unit blocks, one of size 6 of 3x3-unit blocks, and no non-empty, non-full mask is both, so
    every draw shows its size and its count; only empty masks (count 0) hide the size."""
    from mixlabels.strategies import GridMix

    n, alpha, sizes = 6000, 1.0, {4: 2, 6: 3}  # size in px -> side in units
    params = GridMix(NC, cell_sizes=(4, 6), alpha=alpha, mode="elem").sample(
        (n, 1, 12, 12), generator=torch.Generator().manual_seed(5))
    cells = params.cells  # n 6 6
    assert cells.shape == (n, 6, 6)
    outcomes: list[tuple[int, int] | str] = []
    single: dict[int, list[int]] = {4: [], 6: []}  # the one partner cell of count-1 draws
    for mask in cells:
        if not mask.any():
            outcomes.append("empty")
            continue
        found = []
        for size, u in sizes.items():
            coarse = mask.reshape(6 // u, u, 6 // u, u).permute(0, 2, 1, 3).reshape(6 // u, 6 // u, u * u)
            if bool((coarse.all(-1) | ~coarse.any(-1)).all()):  # constant on every block
                found.append((size, coarse.all(-1).flatten()))
        assert len(found) == 1, "a mask of neither (or both) cell sizes"
        size, blocks = found[0]
        outcomes.append((size, int(blocks.sum())))
        if int(blocks.sum()) == 1:
            single[size].append(int(blocks.float().argmax()))
    law: dict[tuple[int, int] | str, float] = {"empty": 0.0}
    for size, u in sizes.items():
        m = (6 // u) ** 2
        law["empty"] += 0.5 * floored_count_p(0, m, alpha)
        law.update({(size, k): 0.5 * floored_count_p(k, m, alpha) for k in range(1, m)})
    assert chi_square_fit(tally(outcomes), law, n) > ALPHA_FALSE
    for size, where in single.items():  # a single partner cell lies anywhere on its size's grid
        m = (6 // sizes[size]) ** 2
        assert len(where) > 20 * m
        assert chi_square_fit(tally(where), {i: 1 / m for i in range(m)}, len(where)) > ALPHA_FALSE


# ---------------------------------------------------------------------- BlockwiseMix: BEiT's blocks
def beit_masking_generator(rng: Any, shape: tuple[int, int], target: int, min_num: int = 16,
                           max_num: int | None = None, min_aspect: float = 0.3, max_aspect: float | None = None) -> np.ndarray:
    """BEiT's ``MaskingGenerator`` (microsoft/unilm, beit/masking_generator.py), as written there, on ``rng``."""
    height, width = shape
    max_num = target if max_num is None else max_num
    max_aspect = max_aspect or 1 / min_aspect
    log_aspect_ratio = (math.log(min_aspect), math.log(max_aspect))
    mask = np.zeros(shape, dtype=int)

    def _mask(max_mask_patches: int) -> int:
        delta = 0
        for _attempt in range(10):
            target_area = rng.uniform(min_num, max_mask_patches)
            aspect_ratio = math.exp(rng.uniform(*log_aspect_ratio))
            h = int(round(math.sqrt(target_area * aspect_ratio)))
            w = int(round(math.sqrt(target_area / aspect_ratio)))
            if w < width and h < height:
                top = rng.randint(0, height - h)
                left = rng.randint(0, width - w)
                num_masked = mask[top : top + h, left : left + w].sum()
                if 0 < h * w - num_masked <= max_mask_patches:
                    for i in range(top, top + h):
                        for j in range(left, left + w):
                            if mask[i, j] == 0:
                                mask[i, j] = 1
                                delta += 1
            if delta > 0:
                break
        return delta

    count = 0
    while count < target:
        delta = _mask(min(target - count, max_num))
        if delta == 0:
            break
        count += delta
    return mask


def block_shape_statistics(masks: Tensor) -> tuple[list[int], list[int]]:
    """Per mask: rows touched minus columns touched (the blocks' aspect), and rows touched."""
    rows = masks.any(dim=2).sum(dim=1)
    cols = masks.any(dim=1).sum(dim=1)
    return (rows - cols).tolist(), rows.tolist()


def two_sample_p(a: list[int], b: list[int], min_count: int = 10) -> float:
    """Chi-square test that two samples of integers come from one law (sparse values pooled at the tails)."""
    values = sorted(set(a) | set(b))
    ta, tb = tally(a), tally(b)
    table, pool = [], [0, 0]
    for v in values:
        row = [ta.get(v, 0), tb.get(v, 0)]
        if sum(row) < min_count:
            pool = [pool[0] + row[0], pool[1] + row[1]]
        else:
            table.append(row)
    if sum(pool):
        table.append(pool)
    return float(stats.chi2_contingency(np.array(table)).pvalue)


def test_blockwise_defaults_are_beit_s() -> None:
    from mixlabels.strategies import BlockwiseMix

    sampler = BlockwiseMix(NC, cell_size=1).sampler
    assert sampler.min_cells == 16  # BEiT's min_num_patches
    assert sampler.log_aspect == pytest.approx((math.log(0.3), math.log(1 / 0.3)))  # min_aspect 0.3, max its inverse


@pytest.mark.parametrize(("grid", "target", "min_cells"), [((14, 14), 75, 16), ((8, 12), 30, 4)])
def test_blockwise_block_shapes_follow_beit_s_masking_generator(grid: tuple[int, int], target: int,
                                                                min_cells: int) -> None:
    """Our vectorised sampler against BEiT's own loop on an independent RNG: the same law of block aspects
    (rows minus columns touched) and extents (rows touched) at BEiT's setting (14x14, 75 cells) and a wide grid."""
    import random

    from mixlabels.strategies._patch import BlockCellSampler

    n = 3000
    sampler = BlockCellSampler(1, 1.0, None, min_cells, None, 0.3, None, "elem", "flip", 1.0)
    ours = sampler.cells_for(n, grid, torch.full((n,), target), torch.Generator().manual_seed(6), torch.device("cpu"))
    rng = random.Random(0)
    beit = torch.from_numpy(np.stack([beit_masking_generator(rng, grid, target, min_cells) for _ in range(n)])).bool()
    assert ours.sum(dim=(1, 2)).float().mean() > 0.9 * target  # the masks reach (about) their target
    for ours_stat, beit_stat in zip(block_shape_statistics(ours), block_shape_statistics(beit)):
        assert two_sample_p(ours_stat, beit_stat) > ALPHA_FALSE


def test_blockwise_shape_test_catches_a_wrong_aspect() -> None:
    """Negative control: blocks of aspect up to 3 only one way (tall) are told apart from BEiT's."""
    import random

    from mixlabels.strategies._patch import BlockCellSampler

    n, grid = 3000, (14, 14)
    tall = BlockCellSampler(1, 1.0, None, 16, None, 1.0, 1 / 0.3, "elem", "flip", 1.0)
    ours = tall.cells_for(n, grid, torch.full((n,), 75), torch.Generator().manual_seed(6), torch.device("cpu"))
    rng = random.Random(0)
    beit = torch.from_numpy(np.stack([beit_masking_generator(rng, grid, 75) for _ in range(n)])).bool()
    assert two_sample_p(block_shape_statistics(ours)[0], block_shape_statistics(beit)[0]) < 1e-6


# ---------------------------------------------------------------------- FMix: the lambda quantile
@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_fmix_keeps_round_lambda_n_cells(alpha: float) -> None:
    """FMix keeps the ``round(lam * n)`` cells of highest noise: the kept count's law is Beta's, binned at
    the half cells."""
    from mixlabels.strategies import FMix

    n_draws, grid = 6000, (4, 4)
    m = grid[0] * grid[1]
    params = FMix(NC, alpha=alpha, mode="elem").sample((n_draws, 1, *grid), generator=torch.Generator().manual_seed(7))
    kept = (~params.cells).sum(dim=(1, 2)).tolist()
    f = beta_cdf(alpha)
    law = {k: float(f(min((k + 0.5) / m, 1.0)) - f(max((k - 0.5) / m, 0.0))) for k in range(m + 1)}
    assert chi_square_fit(tally(kept), law, n_draws) > ALPHA_FALSE


@pytest.mark.parametrize("kind", KINDS)
def test_kornia_record_follows_the_batch_shape(kind: str) -> None:
    """A call's kornia record (``_params``) keeps its shape tensors between calls of one batch shape, and is built
    again for another: its batch gate and input shape always describe the call that made it, and so do
    ``last_params`` and the map of a call made while mixing is off."""
    mixer = make(kind)
    for b in (4, 4, 3, 5):
        x, y = batch(b)
        mixer(x, y)
        record = mixer._params
        assert record["batch_prob"].tolist() == [True] * b
        assert record["forward_input_shape"].tolist() == list(x.shape)
        assert record["mix_params"] is mixer.last_params and mixer.params_batch_size(mixer.last_params)[0] == b
    mixer.mixup_enabled = False
    x, y = batch(2)
    out, lm = mixer(x, y)
    assert out is x and mixer.last_params is None and mixer._params["mix_params"] is None
    assert mixer._params["forward_input_shape"].tolist() == list(x.shape)
    assert maps_equal(mixer.label_map(y), lm)
