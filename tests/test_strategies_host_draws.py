"""Draws as Python numbers (issue 28): no tensor work on the host, the same laws, the same seeds.

The mixers drawing Python numbers (CutMix, MixToken, MixUp, RandomPatchMix, BlockwiseMix, TokenMix,
ResizeMix, GridMix, FMix's lambdas, SaliencyMix's lambdas and box sides, Switch's choice) are sampled with the params built on the ``meta`` device: every operator on a real
(CPU) tensor is then host work that a CUDA batch would pay, and only the seed draw may be one. The
label map's values (sources, weights, the mask and its mean) come in the same buffer: building the
map from meta params runs no operator at all, and gives the bits the CPU computes from the params.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from typing import Any

import pytest
import torch
from scipy import stats
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mixlabels.strategies import (
    BlockwiseMix, CutMix, FMix, GridMix, MixToken, MixUp, RandomPatchMix, ResizeMix, SaliencyMix, SaliencyParams, Switch, TokenMix,
)  # fmt: skip
from mixlabels.strategies._base import pair_label_map
from mixlabels.strategies._cutmix import box_inside, cutmix_boxes
from mixlabels.strategies._saliencymix import saliency_peaks
from mixlabels.strategies._host_draws import column, columns_on, draw_pairs, host_rng, to_fp32
from mixlabels.strategies._sampling import sample_pairs

NC = 10
SEED_DRAW = {"empty", "random_", "_local_scalar_dense"}  # host_rng's one draw from a CPU generator


class HostOps(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch types __init_subclass__ loosely
    """Counts the operators that touch no meta tensor: host work."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.host: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        leaves = [a for a in tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
        to_meta = any(isinstance(a, torch.device) and a.type == "meta" for a in tree_leaves((args, kwargs or {})))
        if not to_meta and not any(t.is_meta for t in leaves) and not getattr(func, "is_view", False):
            self.host[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def mixers() -> list[tuple[str, Any]]:
    return [
        ("cutmix", CutMix(NC)),
        ("cutmix elem minmax", CutMix(NC, minmax=(0.2, 0.8), mode="elem", pairing="derangement", prob=0.5)),
        ("cutmix legacy lam pair", CutMix(NC, correct_lam=False, patch_size=4, mode="pair", prob=0.6)),
        ("mixtoken", MixToken(NC, patch_size=4)),
        ("mixup pair", MixUp(NC, mode="pair", pairing="derangement", prob=0.7)),
        ("random_patch elem", RandomPatchMix(NC, cell_size=4, mode="elem")),
        ("blockwise", BlockwiseMix(NC, cell_size=4, min_cells=4)),
        ("tokenmix elem", TokenMix(NC, patch_size=4, min_tokens=4, mode="elem")),
        ("resizemix", ResizeMix(NC)),
        ("gridmix", GridMix(NC, cell_sizes=(4, 8))),
        ("gridmix elem", GridMix(NC, cell_sizes=(2, 4, 16), alpha=0.5, mode="elem", prob=0.8)),
        ("resizemix cells elem", ResizeMix(NC, scale=(0.0, 0.5), patch_size=4, mode="elem", pairing="derangement", prob=0.7)),
        ("switch", Switch([MixUp(NC), CutMix(NC)])),
        ("fmix", FMix(NC)),
        ("fmix cells pair", FMix(NC, alpha=0.5, cell_size=4, mode="pair", pairing="derangement", prob=0.7)),
    ]


PIXEL_DRAWS = {"fmix", "fmix cells pair"}
"""Mixers that also draw a tensor per pixel (FMix's noise): from the call's generator, on that generator's device."""


@pytest.mark.parametrize("index", range(len(mixers())))
def test_sampling_runs_no_tensor_operator_on_the_host_but_the_seed_draw(index: int) -> None:
    name, mixer = mixers()[index]
    mixer.sample((16, 3, 32, 32), generator=torch.Generator().manual_seed(0))  # warm-up
    # FMix's noise comes from the generator on its device: torch's default one draws it where the params go
    gen = None if name in PIXEL_DRAWS else torch.Generator().manual_seed(0)
    with HostOps() as counter:
        params = mixer.sample((16, 3, 32, 32), generator=gen, device="meta")
    seeds = 2 if name == "switch" else 1  # Switch draws its choice, then the chosen mixer its params
    assert set(counter.host) <= SEED_DRAW and all(n == seeds for n in counter.host.values()), (name, counter.host)
    inner = getattr(params, "params", params)
    assert inner.partner.is_meta and inner.applied.is_meta  # built where asked, not on the host


def test_kornia_params_run_no_host_operator_but_the_seed_draw() -> None:
    mixer = CutMix(NC)
    with HostOps() as counter:
        params = mixer.forward_parameters((16, 3, 32, 32))
    assert set(counter.host) <= SEED_DRAW, counter.host
    assert params["batch_prob"].dtype == torch.bool and params["batch_prob"].tolist() == [True] * 16


def test_params_built_on_the_images_device_equal_the_cpu_ones() -> None:
    """The device only says where the params go: the same seed gives the same params on ``meta`` shapes and CPU values."""
    for _, mixer in mixers():
        cpu = mixer.sample((6, 3, 32, 32), generator=torch.Generator().manual_seed(1))
        meta = mixer.sample((6, 3, 32, 32), generator=torch.Generator().manual_seed(1), device="meta")
        again = mixer.sample((6, 3, 32, 32), generator=torch.Generator().manual_seed(1))
        for a, b, c in zip(tree_leaves(vars(cpu)), tree_leaves(vars(meta)), tree_leaves(vars(again))):
            if isinstance(a, torch.Tensor):
                assert b.is_meta and a.shape == b.shape and a.dtype == b.dtype
                assert torch.equal(a, c)


def test_columns_come_back_as_typed_views_of_one_buffer() -> None:
    a, b, c, d = columns_on(
        [column([3, 0, 2], torch.int64), column([True, False], torch.bool), column([0.1], torch.float32),
         column([1, 2, 3, 4], torch.int64, 2, 2)],
        torch.device("cpu"),
    )  # fmt: skip
    assert a.tolist() == [3, 0, 2] and a.dtype == torch.int64 and b.tolist() == [True, False] and b.dtype == torch.bool
    assert_close(c, torch.tensor([0.1]))  # rounded once to fp32
    assert d.tolist() == [[1, 2], [3, 4]]
    # one buffer, each column at its aligned offset (24 bytes of a, 2 of b and 4 of c each rounded up to 8): no copy
    assert [t.data_ptr() - a.data_ptr() for t in (b, c, d)] == [24, 32, 40]
    assert to_fp32(0.1) == torch.tensor(0.1).item()


class DeviceOps(TorchDispatchMode):  # type: ignore[no-untyped-call]  # as HostOps
    """Counts the operators that touch a meta tensor (views apart): kernels a CUDA batch would launch."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        leaves = [a for a in tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
        if any(t.is_meta for t in leaves) and not getattr(func, "is_view", False):
            self.device[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("index", range(len(mixers())))
def test_the_label_map_takes_the_values_drawn_with_the_params_no_device_operator(index: int) -> None:
    """Sources, image weights and the mask come in the params' one buffer: building the map runs no kernel."""
    name, mixer = mixers()[index]
    params = mixer.sample((16, 3, 32, 32), generator=torch.Generator().manual_seed(0), device="meta")
    labels = torch.empty(16, dtype=torch.long, device="meta")
    with DeviceOps() as counter, HostOps() as host:
        lm = mixer.label_map_from(params, labels)
    assert not counter.device and not host.host, (name, counter.device, host.host)
    assert lm.sources.is_meta and lm.image_weights.is_meta and lm.mask.device.type == "meta"


@pytest.mark.parametrize("index", range(len(mixers())))
def test_drawn_label_values_equal_the_ones_computed_from_the_params(index: int) -> None:
    """The Python arithmetic gives the CPU path's bits: drop the drawn values and the map is the same."""
    name, mixer = mixers()[index]
    for seed in range(4):
        params = mixer.sample((7, 3, 32, 32), generator=torch.Generator().manual_seed(seed))  # odd: one unmixed
        inner = getattr(params, "params", params)
        assert inner.label_sources is not None and inner.label_weights is not None, name
        bare = dataclasses.replace(
            inner, label_sources=None, label_weights=None, label_cells=None, **({"keep": None} if hasattr(inner, "keep") else {})
        )
        if hasattr(inner, "keep"):
            assert torch.equal(inner.keep_cells(), bare.keep_cells())
        drawn, computed = pair_label_map(inner, torch.arange(7), NC, 0.1), pair_label_map(bare, torch.arange(7), NC, 0.1)
        assert type(drawn.mask) is type(computed.mask), name
        assert torch.equal(drawn.sources, computed.sources), name
        assert torch.equal(drawn.image_weights, computed.image_weights), (name, drawn.image_weights, computed.image_weights)
        assert torch.equal(drawn.mask.dense(), computed.mask.dense()), name
        assert torch.equal(drawn.image_targets(), computed.image_targets()), name


@pytest.mark.parametrize("index", range(len(mixers())))
def test_a_replaced_draw_drops_the_values_derived_from_it(index: int) -> None:
    """``dataclasses.replace`` copies the derived values (sources, weights, cells, keep, the pixel box, whether
    any sample is unmixed): with a draw replaced they would describe the old draw, labels no longer matching the
    pixels. ``mix`` then recomputes them from the draws, as for params that never had them."""
    name, mixer = mixers()[index]
    images, labels = torch.randn(7, 3, 32, 32), torch.arange(7)
    params = mixer.sample(images.shape, generator=torch.Generator().manual_seed(1))
    inner = getattr(params, "params", params)
    other = dataclasses.replace(inner, partner=inner.partner.roll(1))  # a partner the derived sources do not name
    assert other.current() is not other and other.current().label_sources is None, name
    assert inner.current() is inner and dataclasses.replace(inner).current().label_sources is inner.label_sources
    cleared = {n: None for n in type(inner).DERIVED}
    bare = dataclasses.replace(inner, partner=other.partner, **cleared, drawn_from=None)
    owner = getattr(mixer, "mixers", [mixer])
    chosen = owner[params.choice] if hasattr(params, "choice") else mixer
    got_images, got = chosen.mix(images, labels, other)
    want_images, want = chosen.mix(images, labels, bare)
    assert torch.equal(got.sources, want.sources) and torch.equal(got.sources[:, 1], other.partner), name
    assert torch.equal(got.image_weights, want.image_weights) and torch.equal(got.mask.dense(), want.mask.dense()), name
    assert torch.equal(got_images, want_images), name
    moved = other.to("cpu")  # moving does not revive them either
    assert moved.label_sources is None and moved.current() is moved, name


def test_resizemix_host_boxes_follow_the_tensor_draws_law() -> None:
    """ResizeMix's Python draws (a side ratio and a corner per group) against its tensor draws: the same law for every
    corner (two-sample KS), empty draws marked unmixed and zeroed on both."""
    sampler = ResizeMix(NC, scale=(0.0, 0.8), mode="elem").sampler
    b, size = 3000, (64, 48)
    host = sampler((b, 3, *size), generator=torch.Generator().manual_seed(0))
    pairs = sample_pairs(b, "elem", "flip", 1.0, torch.Generator().manual_seed(1), torch.device("cpu"))
    tensor = sampler.draw(pairs, size, torch.Generator().manual_seed(2), torch.device("cpu"))
    for p in (host, tensor):
        empty = (p.boxes[:, 1] == p.boxes[:, 0]) | (p.boxes[:, 3] == p.boxes[:, 2])
        assert torch.equal(~empty, p.applied) and not p.boxes[empty].any()
        assert 0.0 < empty.float().mean() < 0.1  # tau * 48 < 1: about 1 in 38
    for col in range(4):
        assert stats.ks_2samp(host.boxes[:, col].numpy(), tensor.boxes[:, col].numpy()).pvalue > 1e-3, col


def test_gridmix_host_cells_follow_the_tensor_draws_law() -> None:
    """GridMix's Python draws against its tensor draws: per sample the drawn size (the blocks the cells make), and for
    each size the number of the partner's cells (two-sample KS); each of that size's cells as likely as another."""
    sampler = GridMix(NC, cell_sizes=(4, 8, 16), alpha=0.7, mode="elem").sampler
    b, size = 3000, (16, 32)
    host = sampler((b, 3, *size), generator=torch.Generator().manual_seed(0))
    pairs = sample_pairs(b, "elem", "flip", 1.0, torch.Generator().manual_seed(1), torch.device("cpu"))
    tensor = sampler.draw(pairs, size, torch.Generator().manual_seed(2), torch.device("cpu"))

    def by_size(cells: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each sample's cells by the largest size whose blocks they are (4 px cells: the common grid's)."""
        out: dict[int, list[torch.Tensor]] = {4: [], 8: [], 16: []}
        for c in cells:
            f = next(s for s in (16, 8, 4) if torch.equal(c, c[:: s // 4, :: s // 4].repeat_interleave(s // 4, 0).repeat_interleave(s // 4, 1)))
            out[f].append(c[:: f // 4, :: f // 4].flatten())
        return {f: torch.stack(v) for f, v in out.items() if v}

    a, t = by_size(host.cells), by_size(tensor.cells)
    for f in (4, 8):  # 16 px cells: 2 of them, their counts too coarse for a KS test (and 16 px blocks are 8 px ones too)
        assert abs(len(a[f]) / b - len(t[f]) / b) < 0.06, f
        assert stats.ks_2samp(a[f].sum(1).numpy(), t[f].sum(1).numpy()).pvalue > 1e-3, f
        per_cell = a[f].float().mean(0)  # every cell equally likely the partner's
        assert (per_cell - per_cell.mean()).abs().max() < 0.08, (f, per_cell)


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
@pytest.mark.parametrize("pairing", ["flip", "roll"])
def test_fixed_pairings_and_groups_are_sample_pairs(mode: str, pairing: str) -> None:
    """The deterministic pairings and groups are ``sample_pairs``' ones, odd batches and a batch of one included."""
    if pairing == "roll" and mode == "pair":
        return
    for b in (1, 2, 5, 8):
        ours = draw_pairs(b, mode, pairing, 1.0, random.Random(0))  # type: ignore[arg-type]
        ref = sample_pairs(b, mode, pairing, 1.0, None, torch.device("cpu"))  # type: ignore[arg-type]
        assert ours.partner == ref.partner.tolist() and ours.group == ref.group.tolist()
        assert ours.num_groups == ref.num_groups and ours.applied == ref.applied.tolist()


def test_derangement_partner_is_uniform_over_the_others_and_pairs_are_matchings() -> None:
    rng, b, n = random.Random(0), 5, 6000
    firsts: Counter[int] = Counter()
    for _ in range(n):
        elem = draw_pairs(b, "elem", "derangement", 1.0, rng)
        assert all(p != i for i, p in enumerate(elem.partner)) and sorted(elem.partner) == list(range(b))
        firsts[elem.partner[0]] += 1
        pair = draw_pairs(b, "pair", "derangement", 1.0, rng)
        assert all(pair.partner[p] == i for i, p in enumerate(pair.partner))  # symmetric
        assert sum(p == i for i, p in enumerate(pair.partner)) == 1  # the odd one out
        assert all(pair.group[i] == pair.group[p] for i, p in enumerate(pair.partner)) and pair.num_groups == 3
    assert set(firsts) == {1, 2, 3, 4}
    assert stats.chisquare([firsts[k] for k in (1, 2, 3, 4)]).pvalue > 1e-3


def test_the_gate_mixes_each_group_with_its_prob() -> None:
    rng, n = random.Random(1), 4000
    mixed = sum(draw_pairs(2, "batch", "flip", 0.3, rng).applied[0] for _ in range(n))
    assert stats.binomtest(mixed, n, 0.3).pvalue > 1e-3
    assert not any(draw_pairs(4, "elem", "flip", 0.0, rng).applied)


def test_random_cells_are_a_uniform_subset_of_the_count() -> None:
    mixer = RandomPatchMix(NC, cell_size=1, ratio=0.25, mode="elem")
    cells = mixer.sample((3000, 1, 4, 4), generator=torch.Generator().manual_seed(2)).cells.view(3000, 16)
    assert (cells.sum(1) == 4).all()
    per_cell = cells.sum(0).tolist()
    assert stats.chisquare(per_cell).pvalue > 1e-3


def test_one_seed_per_call_advances_the_generator() -> None:
    gen = torch.Generator().manual_seed(5)
    first = host_rng(gen).random()
    assert host_rng(gen).random() != first
    assert host_rng(torch.Generator().manual_seed(5)).random() == first


def saliency_reference(params: SaliencyParams, images: torch.Tensor) -> torch.Tensor:
    """SaliencyMix's boxes from the draws alone: every partner's peak, then ``cutmix_boxes`` of the lambda there."""
    cy, cx = saliency_peaks(images, params.grid)
    boxes = cutmix_boxes(params.lam, cy[params.partner], cx[params.partner], params.grid)
    return torch.where(params.applied[:, None], boxes, torch.zeros_like(boxes))


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
@pytest.mark.parametrize("cell", [None, 4])
def test_saliencymix_host_sides_place_the_reference_boxes(mode: str, cell: int | None) -> None:
    """The sides the sampler fixed from its Python lambdas, clamped around the partners' peaks, are the reference boxes
    (``cutmix_boxes`` at ``saliency_peaks``) bit for bit, and the label weights the box mask's mean (``BoxMask``): for
    every batch size (0, one, odd with its unmixed middle sample), gated or not; the pixels are the reference's."""
    mixer = SaliencyMix(NC, alpha=0.6, patch_size=cell, mode=mode, prob=0.6)  # type: ignore[arg-type]
    for b, seed in ((0, 0), (1, 1), (7, 2), (8, 3), (8, 4)):
        x, y = torch.rand(b, 3, 32, 24, generator=torch.Generator().manual_seed(seed)), torch.arange(b) % NC
        out, lm = mixer(x, y, generator=torch.Generator().manual_seed(seed))
        placed = mixer.last_params
        assert isinstance(placed, SaliencyParams) and placed.boxes is not None and placed.box_reach is not None
        boxes = saliency_reference(placed, x)
        assert torch.equal(placed.boxes, boxes), (b, seed)
        bare = SaliencyParams(partner=placed.partner, applied=placed.applied, image_size=placed.image_size, lam=placed.lam, grid=placed.grid)
        again, want = mixer(x, y, params=bare)  # placed from lam alone (the tensor draws' way)
        assert torch.equal(out, again) and torch.equal(lm.image_weights, want.image_weights)
        assert torch.equal(lm.sources, want.sources) and torch.equal(lm.mask.dense(), want.mask.dense())
        assert torch.equal(lm.image_weights[:, 0], lm.mask.dense()[:, 0].mean((1, 2)))


def test_saliencymix_places_on_the_device_with_no_host_operator() -> None:
    """Sampling takes the seed draw on the host alone; placing on the images' device (meta: every operator there would
    be a launch) runs no host operator, and the map takes the placed values with no operator at all."""
    mixer = SaliencyMix(NC, patch_size=4, mode="elem", prob=0.7)
    with HostOps() as counter:
        params = mixer.sample((16, 3, 32, 32), generator=torch.Generator().manual_seed(0), device="meta")
        placed = mixer.place(params, torch.empty(16, 3, 32, 32, device="meta"))
    assert set(counter.host) <= SEED_DRAW and all(n == 1 for n in counter.host.values()), counter.host
    assert placed.boxes is not None and placed.boxes.is_meta and placed.label_weights is not None
    with DeviceOps() as device, HostOps() as host:
        lm = mixer.label_map_from(placed, torch.empty(16, dtype=torch.long, device="meta"))
    assert not device.device and not host.host and lm.image_weights.is_meta


def test_saliencymix_a_replaced_lambda_places_from_the_lambda() -> None:
    """A replaced lambda drops the sides fixed from the old one: the boxes follow the new lambda."""
    mixer = SaliencyMix(NC, mode="elem")
    x = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    params = mixer.sample(x.shape, generator=torch.Generator().manual_seed(1))
    other = dataclasses.replace(params, lam=torch.where(params.applied, torch.full_like(params.lam, 0.25), params.lam))
    assert other.current().box_reach is None
    assert torch.equal(mixer.place(other, x).boxes, saliency_reference(other, x))
    assert torch.equal(mixer.place(params, x).boxes, saliency_reference(params, x))


def test_saliencymix_and_fmix_host_lambdas_follow_the_tensor_draws_law() -> None:
    """The Python lambdas against the tensor draws (``draw``): the same Beta law (two-sample KS), SaliencyMix's lambda
    directly, FMix's through the count of cells it keeps."""
    b = 3000
    pairs = sample_pairs(b, "elem", "flip", 1.0, torch.Generator().manual_seed(1), torch.device("cpu"))
    sal = SaliencyMix(NC, alpha=0.5, mode="elem").sampler
    host = sal((b, 3, 16, 16), generator=torch.Generator().manual_seed(0)).lam
    tensor = sal.draw(pairs, (16, 16), torch.Generator().manual_seed(2), torch.device("cpu")).lam
    assert stats.ks_2samp(host.numpy(), tensor.numpy()).pvalue > 1e-3
    fmix = FMix(NC, alpha=0.5, mode="elem").sampler
    host_kept = (~fmix((b, 1, 8, 8), generator=torch.Generator().manual_seed(0)).cells).sum((1, 2))
    tensor_kept = (~fmix.draw(pairs, (8, 8), torch.Generator().manual_seed(2), torch.device("cpu")).cells).sum((1, 2))
    assert stats.ks_2samp(host_kept.numpy(), tensor_kept.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("mode", ["pair", "elem"])
@pytest.mark.parametrize("kw", [{}, {"patch_size": 4}, {"minmax": (0.2, 0.7)}])
def test_cutmix_host_keep_axes_are_the_cells_outside_the_boxes(mode: str, kw: dict[str, Any]) -> None:
    """A box per sample: the rows and columns outside each box, drawn with it, give the cells outside it (the keep
    mask the pixels are selected by), empty boxes of unmixed samples keeping everything; a replaced box drops them."""
    mixer = CutMix(NC, mode=mode, prob=0.7, **kw)  # type: ignore[arg-type]
    for b, seed in ((0, 0), (1, 1), (7, 2), (16, 3)):
        params = mixer.sample((b, 3, 32, 24), generator=torch.Generator().manual_seed(seed))
        assert params.keep_axes is not None and params.keep_axes.shape == (b, 2, max(params.grid))
        assert torch.equal(params.keep_cells(), ~box_inside(params.boxes, params.grid)), (b, seed)
        assert params.keep_cells()[~params.applied].all()
        other = dataclasses.replace(params, boxes=params.boxes.flip(0))
        assert torch.equal(other.keep_cells(), ~box_inside(other.boxes, other.grid))
