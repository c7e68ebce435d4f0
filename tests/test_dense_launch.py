"""The GPU's eager route mixes labels by explicit matrices on grids up to 14x14 (``_DENSE_LAUNCH_TOKENS``).

On the CPU in eager mode, and in compiled graphs, label convs on grids over 64 positions run as depthwise convolutions
(a conv, a division by the in-grid tap weights, and those weights a conv per grid); where every operator is a
launch (a GPU, ``launch_routes``), grids up to 196 positions take the tap matrices instead: one product a conv, the
matrices of all a forward's convs of one kernel shape on a grid built together. Here: which route each device and
grid takes; the matrix route against the depthwise one and against float64 matrices written out tap by tap, on
grids of 65 to 196 positions; every family on that route against its reference; and a planted fault (the matrices
left unnormalised) that the family check must catch.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_backbones_common import _fast_and_reference
from torch import Tensor
from torch.testing import assert_close

from mixlabels import backbones
from mixlabels._trackers import CompactTracker
from mixlabels.backbones import _common, _convnet
from mixlabels.backbones._common import conv_chain, depthwise_route, launch_matrices, launch_routes
from mixlabels.backbones._dense import conv_matrix, row_normalise

CPU = torch.device("cpu")
FAMILIES = {f.name: f for f in backbones.FAMILIES if f.name != "any"}


def test_the_route_by_device_and_grid() -> None:
    assert depthwise_route((14, 14), CPU) and depthwise_route((9, 8), CPU)  # the CPU's eager walk: over 64, convs
    assert not depthwise_route((8, 8), CPU)
    with launch_routes():  # a GPU's: matrices up to 196 positions
        assert not depthwise_route((14, 14), CPU) and not depthwise_route((9, 8), CPU) and not depthwise_route((7, 28), CPU)
        assert depthwise_route((15, 14), CPU) and depthwise_route((28, 28), CPU)
        with launch_matrices(False):  # the fallback a GPU can be told to take (gpu_suite --family-routes matrices=cpu)
            assert depthwise_route((14, 14), CPU) and not depthwise_route((8, 8), CPU)
        assert not depthwise_route((14, 14), CPU)
    assert depthwise_route((14, 14), CPU)  # and back


def _reference(labels: Tensor, grid: tuple[int, int], steps: list[tuple[Tensor, tuple[int, int], tuple[int, int]]]) -> Tensor:
    y = labels.double()
    for kernel, padding, dilation in steps:
        m, _ = conv_matrix(grid, kernel.double(), padding=padding, dilation=dilation)
        y = row_normalise(m) @ y
    return y


@pytest.mark.parametrize("grid", [(14, 14), (9, 8), (13, 11), (7, 28)])
@pytest.mark.parametrize("shape", ["3x3", "7x7", "3x3 dilated", "1x5"])
def test_matrices_on_a_gpus_route_equal_the_depthwise_convs_and_the_reference(grid: tuple[int, int], shape: str) -> None:
    g = torch.Generator().manual_seed(sum(grid) + len(shape))
    kh, kw, padding, dilation = {"3x3": (3, 3, (1, 1), (1, 1)), "7x7": (7, 7, (3, 3), (1, 1)),
                                 "3x3 dilated": (3, 3, (2, 2), (2, 2)), "1x5": (1, 5, (0, 2), (1, 1))}[shape]
    steps = [(torch.rand(kh, kw, generator=g) + 0.01, padding, dilation) for _ in range(3)]
    labels = torch.rand(3, grid[0] * grid[1], 4, generator=g).softmax(dim=-1)
    convs = conv_chain(labels, grid, steps)  # the CPU's eager route: depthwise convs
    with launch_routes():
        matrices = conv_chain(labels, grid, steps)
    assert_close(matrices, convs, rtol=1e-6, atol=1e-6)
    assert_close(matrices.double(), _reference(labels, grid, steps), rtol=1e-6, atol=1e-6)
    assert_close(matrices.sum(-1), torch.ones(labels.shape[:2]))
    assert not torch.equal(matrices, labels)  # the labels moved


@pytest.mark.parametrize("shape", ["3x3", "5x5 dilated", "1x5"])
def test_a_gpus_tap_matrices_carry_their_rows_tap_weights(shape: str) -> None:
    """Where every operator is a launch, the tap matrices carry each tap's in-grid indicator after their entries
    (``_weighted_tap_matrices``), so that one product makes a conv's matrix and every row's in-grid tap weight: no
    sum is dispatched, and the matrices equal the CPU's (the plain matrices' row sums) to rounding, for a stack of
    kernels, one kernel, and a conv over two label states (``conv_mix_pair``)."""
    from benchmarks._op_counter import OpCounter
    from mixlabels.backbones._common import _tap_matrices, conv_mix_pair, tap_matrices_for, tap_mixes

    kh, kw, padding, dilation = {"3x3": (3, 3, (1, 1), (1, 1)), "5x5 dilated": (5, 5, (4, 4), (2, 2)),
                                 "1x5": (1, 5, (0, 2), (1, 1))}[shape]
    grid = (7, 9)
    n = grid[0] * grid[1]
    g = torch.Generator().manual_seed(kh * 10 + kw)
    kernels = torch.rand(4, kh * kw, generator=g) + 0.01
    plain = tap_matrices_for(grid, (kh, kw), padding, dilation, CPU)
    assert plain.shape == (kh * kw, n * n) and torch.equal(plain, _tap_matrices(grid, (kh, kw), padding, dilation, CPU))
    with launch_routes():
        weighted = tap_matrices_for(grid, (kh, kw), padding, dilation, CPU)
        assert weighted.shape == (kh * kw, n * n + n) and torch.equal(weighted[:, : n * n], plain)
        with OpCounter() as ops:
            many, one = tap_mixes(kernels, weighted, (4, n, n)), tap_mixes(kernels[1:2], weighted, (n, n))
        assert "sum" not in ops.ops and ops.ops["mm"] == 2, ops.ops
        labels = torch.rand(2, n, 3, generator=g).softmax(-1), torch.rand(2, n, 3, generator=g).softmax(-1)
        halves = kernels[2].view(kh, kw) * 0.3, kernels[3].view(kh, kw) * 0.7
        pair = conv_mix_pair(*labels, grid, *halves, padding, dilation)
    assert_close(many, tap_mixes(kernels, plain, (4, n, n)), rtol=1e-6, atol=1e-7)
    assert_close(one, tap_mixes(kernels[1:2], plain, (n, n)), rtol=1e-6, atol=1e-7)
    assert_close(many.sum(-1), torch.ones(4, n))
    assert_close(pair, conv_mix_pair(*labels, grid, *halves, padding, dilation), rtol=1e-6, atol=1e-7)
    assert not torch.equal(pair, labels[0])


@pytest.mark.parametrize("shape", ["3x3", "5x5 dilated", "1x5"])
def test_a_conv_over_two_label_states_on_a_large_grid_launches_five_operators(shape: str) -> None:
    """``conv_mix_pair`` (MobileViT's fusion) on a grid of the depthwise route: where every operator is a launch, both
    states are stacked position-major (one copy, read as a channels-last map as it lies) and both halves' in-grid tap
    weight is one conv of the cached ones over two channels: five computing operators, where the CPU's route takes
    eight, and the labels of an explicit float64 sum over each half's in-grid taps (and the CPU route's, to
    rounding). Each half counts: zeroing either kernel changes the labels."""
    from benchmarks._op_counter import OpCounter
    from mixlabels.backbones._common import conv_mix_pair

    kh, kw, padding, dilation = {"3x3": (3, 3, (1, 1), (1, 1)), "5x5 dilated": (5, 5, (4, 4), (2, 2)),
                                 "1x5": (1, 5, (0, 2), (1, 1))}[shape]
    grid = (16, 15)  # 240 positions: over _DENSE_LAUNCH_TOKENS, the depthwise route on both
    g = torch.Generator().manual_seed(kh * 7 + kw)
    first, second = (torch.rand(2, grid[0] * grid[1], 3, generator=g).softmax(-1) for _ in range(2))
    k1, k2 = torch.rand(kh, kw, generator=g) * 0.4, torch.rand(kh, kw, generator=g) * 0.6
    assert depthwise_route(grid, CPU)
    with launch_routes():
        assert depthwise_route(grid, CPU)
        conv_mix_pair(first, second, grid, k1, k2, padding, dilation)  # the grid's ones built (cached)
        with OpCounter() as ops:
            got = conv_mix_pair(first, second, grid, k1, k2, padding, dilation)
    assert ops.kernels == 5 and "ones_like" not in ops.ops and "sum" not in ops.ops, ops.ops
    with OpCounter() as cpu_ops:
        cpu = conv_mix_pair(first, second, grid, k1, k2, padding, dilation)
    assert cpu_ops.kernels == 8, cpu_ops.ops

    def explicit(a: Tensor, b: Tensor, ka: Tensor, kb: Tensor) -> Tensor:
        def conv(x: Tensor, k: Tensor) -> Tensor:  # (n, c, h, w) float64, each channel alone
            c = int(x.shape[1])
            return torch.nn.functional.conv2d(x, k.double().expand(c, 1, kh, kw), padding=padding, dilation=dilation, groups=c)

        grid_of = lambda t: t.double().transpose(1, 2).reshape(t.shape[0], -1, *grid)  # noqa: E731
        ones = torch.ones(1, 1, *grid, dtype=torch.float64)
        mixed = (conv(grid_of(a), ka) + conv(grid_of(b), kb)) / (conv(ones, ka) + conv(ones, kb))
        return mixed.flatten(2).transpose(1, 2)

    assert_close(got.double(), explicit(first, second, k1, k2), rtol=1e-6, atol=1e-7)
    assert_close(got, cpu, rtol=1e-6, atol=1e-7)
    assert_close(got.sum(-1), torch.ones(got.shape[:2]))
    with launch_routes():
        for zeroed in (conv_mix_pair(first, second, grid, k1 * 0, k2, padding, dilation),
                       conv_mix_pair(first, second, grid, k1, k2 * 0, padding, dilation)):
            assert (zeroed - got).abs().max() > 1e-3


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("every_grid", [False, True], ids=["up to 14x14", "every grid"])
def test_every_family_on_the_matrix_route_equals_its_reference(family: str, every_grid: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The examples' grids (32 px: 16x16 and smaller) under a GPU's routes; ``every_grid``: the matrices taken on
    every grid, the examples' 16x16 first grids included, and a forward's kernels of one shape stacked and their
    matrices built together however few they are (``_WIDE_GROUP``: the examples have fewer than five alike), which
    folds every residual whose branch is one conv (``residual_labels``)."""
    if every_grid:
        monkeypatch.setattr(_common, "_DENSE_LAUNCH_TOKENS", 10**6)
        monkeypatch.setattr(_convnet, "_WIDE_GROUP", 1)
    model = FAMILIES[family].example()
    with launch_routes():
        _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), "tl_align")  # targets and logits to 1e-5


@pytest.mark.parametrize("family", ["resnet", "convnext", "mobilenetv3"])
def test_unnormalised_matrices_fail_the_family_check(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control of the test above: matrices whose rows keep their in-grid tap weight (the border's division
    forgotten) no longer give the reference's targets."""
    fired: list[int] = []

    def unnormalised(kernels: Tensor, taps: Tensor, shape: tuple[int, ...]) -> Tensor:
        fired.append(1)
        return (kernels @ taps)[..., : shape[-1] * shape[-1]].reshape(shape)  # the entries; any tap weights after them unread

    monkeypatch.setattr(_common, "tap_mixes", unnormalised)  # a chain's own matrices
    monkeypatch.setattr(_convnet, "tap_mixes", unnormalised)  # and a forward's, built together (``Kernels.matrix``)
    monkeypatch.setattr(_common, "_DENSE_LAUNCH_TOKENS", 10**6)
    model = FAMILIES[family].example()
    with launch_routes(), pytest.raises(AssertionError):
        _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), "tl_align")
    assert fired, "the plant never fired: no matrix was built"


class _Folds:
    """Counts the calls of a ``CompactTracker`` method by which a fold hands its map over: ``residual_by``, a residual
    whose mean folded into the branch's matrix; ``projected_by``, a downsampling block's shortcut and branch in one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, method: str = "residual_by") -> None:
        self.calls = 0
        real = getattr(CompactTracker, method)

        def counted(tracker: CompactTracker, *args: Any) -> None:
            self.calls += 1
            real(tracker, *args)

        monkeypatch.setattr(CompactTracker, method, counted)


def _folded_and_fallback(model: torch.nn.Module, scheme: str, folds: _Folds, what: str) -> tuple[Any, Any]:
    """The fast path's outputs (each against the reference's) on a GPU's routes with the folds, then without them
    (``folded_residuals(False)``, the fallback ``gpu_suite --family-routes residuals=lerp`` times): some folded,
    then none."""
    with launch_routes():
        folded, _, _ = _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), scheme)
    assert folds.calls > 0, f"no {what} folded: this test checked nothing new"
    calls = folds.calls
    with launch_routes(), _convnet.folded_residuals(False):
        unfolded, _, _ = _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), scheme)
    assert folds.calls == calls  # the route switched off: nothing folded
    return folded, unfolded


FOLDING = ["convnext", "mobilenetv3", "regnet", "edgenext", "resnet", "starnet", "fasternet", "mambaout", "inception_next"]
"""Families whose examples have blocks whose branch is spatial convs alone behind an identity shortcut (the fold's
case: one conv, ConvNeXt's and the inverted residuals'; a chain of two, ResNet's basic block and StarNet's; a partial
conv, FasterNet's and MambaOut's, whose concatenation folds too: ``partial_branch``; a fused join with an identity
branch, InceptionNeXt's token mixer, whose shares take the residual's mean: ``folded_shares``; the test asserts that
some folded)."""


@pytest.mark.parametrize("family", FOLDING)
@pytest.mark.parametrize("scheme", ["tl_align", "tl_no_norm"])
def test_a_residual_folded_into_its_conv_matrix_equals_the_product_and_lerp(family: str, scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU's route a residual whose branch is convs alone on a small grid is one product with
    ``lerp(I, M_k ... M_1, s)`` (``s`` 1/2, or 1 without normalisation): the targets of the products and ``lerp`` to
    rounding, and the reference's."""
    monkeypatch.setattr(_convnet, "_WIDE_GROUP", 1)  # the examples' few convs of a shape made together, as a real model's
    folded, unfolded = _folded_and_fallback(FAMILIES[family].example(), scheme, _Folds(monkeypatch), "residual")
    assert_close(folded.target, unfolded.target, rtol=1e-6, atol=1e-6)


def _without_identity(self: _convnet.Kernels, conv: Any, grid: tuple[int, int], share: float, batch: int) -> Tensor | None:
    m = self.matrix(conv, grid)
    return None if m is None else (m * share).expand(batch, -1, -1)


@pytest.mark.parametrize(("family", "plant"), [("convnext", "one conv"), ("resnet", "chain")])
def test_a_residual_map_without_its_identity_fails_the_family_check(family: str, plant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the residual's map made as ``s M`` for one conv (the labels' own share forgotten), or as
    ``s M_2 M_1`` for a chain (ResNet's basic blocks: the identity taken as zeros), gives other targets."""
    if plant == "one conv":
        monkeypatch.setattr(_convnet.Kernels, "residual", _without_identity)
    else:
        monkeypatch.setattr(_convnet, "_identity", lambda n, device: torch.zeros(n, n, device=device))
    monkeypatch.setattr(_convnet, "_WIDE_GROUP", 1)
    folds = _Folds(monkeypatch)
    model = FAMILIES[family].example()
    with launch_routes(), pytest.raises(AssertionError):
        _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), "tl_align")
    assert folds.calls > 0


def test_a_partial_convs_branch_is_its_chain_and_share() -> None:
    conv, other = torch.nn.Conv2d(2, 2, 3, padding=1), torch.nn.Conv2d(2, 2, 3, padding=1)
    Parallel = _convnet.Parallel
    assert _convnet.partial_branch((Parallel.concat([(conv,), ()], [1, 3]),)) == ((conv,), 0.25)
    assert _convnet.partial_branch((Parallel.concat([(), (conv, other)], [3, 1]),)) == ((conv, other), 0.25)
    assert _convnet.partial_branch((Parallel.concat([(conv,), (other,)], [1, 3]),)) is None  # no identity
    assert _convnet.partial_branch((Parallel.concat([(conv,), (), ()], [1, 1, 2]),)) is None  # three branches
    assert _convnet.partial_branch((Parallel.concat([(conv,), ()], [1, 3]), conv)) is None  # more after the join
    window = _convnet.Window((2, 2), (2, 2), (0, 0))
    assert _convnet.partial_branch((Parallel.concat([(window,), ()], [1, 3]),)) is None  # not convs alone
    assert _convnet.partial_branch((conv,)) is None


@pytest.mark.parametrize("family", ["fasternet", "mambaout"])
@pytest.mark.parametrize("every_grid", [False, True], ids=["lerp", "matrix"])
def test_a_partial_conv_folded_by_the_whole_channel_share_fails_the_family_check(
    family: str, every_grid: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control of the partial fold: the chain's map taken by the residual's share alone (its channel share ``p``
    forgotten: as if it convolved every channel) gives other targets, on the one-``lerp`` route and the matrix one."""
    real = _convnet.partial_branch
    planted: list[int] = []

    def whole(branch: Any) -> Any:
        found = real(branch)
        if found is not None:
            planted.append(1)
            return found[0], 1.0
        return None

    monkeypatch.setattr(_convnet, "partial_branch", whole)
    if every_grid:
        monkeypatch.setattr(_common, "_DENSE_LAUNCH_TOKENS", 10**6)
        monkeypatch.setattr(_convnet, "_WIDE_GROUP", 1)
    model = FAMILIES[family].example()
    with launch_routes(), pytest.raises(AssertionError):
        _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), "tl_align")
    assert planted, "the plant never fired: no partial conv's branch was seen"


def test_a_joins_folded_shares_are_the_residuals_lerp() -> None:
    shape = ((3, 3), None, (1, 5), (5, 1))
    shares = (0.125, 0.625, 0.125, 0.125)
    folded = _convnet.folded_shares(shares, shape, 0.5)
    assert folded == (0.0625, 0.8125, 0.0625, 0.0625)  # r s_i, the identity's raised by 1 - r
    assert sum(folded) == 1.0
    assert _convnet.folded_shares(shares, shape, 1.0) == shares  # without normalisation: the join itself
    with pytest.raises(ValueError):
        _convnet.folded_shares(shares, ((3, 3), (1, 5)), 0.5)  # no identity to take the labels' own share


def test_a_join_folded_without_the_labels_own_share_fails_the_family_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control of the join fold: shares scaled by the residual's but the identity's not raised (the labels' own
    half of the residual forgotten, the rows renormalised by the tap weights alone) give other targets."""
    planted: list[int] = []

    def forgetful(shares: Any, shape: Any, residual: float) -> tuple[float, ...]:
        planted.append(1)
        return tuple(residual * s for s in shares)

    monkeypatch.setattr(_convnet, "folded_shares", forgetful)
    model = FAMILIES["inception_next"].example()
    with launch_routes(), pytest.raises(AssertionError):
        _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), "tl_align")
    assert planted, "the plant never fired: no join folded its residual"


def test_the_residual_maps_of_a_grid_are_the_lerps_of_its_matrices() -> None:
    convs = [torch.nn.Conv2d(4, 4, 3, padding=1, groups=4) for _ in range(_convnet._WIDE_GROUP)]
    convs.append(torch.nn.Conv2d(4, 4, 5, padding=2, groups=4))
    kernels = _convnet.Kernels(convs)
    for grid in ((7, 7), (14, 14), (5, 9)):
        eye = torch.eye(grid[0] * grid[1])
        for conv in convs:
            for share in (0.5, 1.0):
                m, expanded = kernels.matrix(conv, grid), kernels.residual(conv, grid, share, batch=3)
                if m is None:  # the 5x5 conv alone in its shape: too few alike, built per step by conv_chain
                    assert expanded is None and conv is convs[-1]
                    continue
                assert expanded is not None and expanded.shape == (3, *m.shape)  # mix_tokens' batched product reads it so
                r = torch.lerp(eye, m, share)
                assert all(torch.equal(e, r) for e in expanded)
                assert_close(expanded[0].sum(-1), torch.ones(r.shape[0]))


def test_residual_by_refuses_a_layer_the_scheme_does_not_align() -> None:
    from test_backbones_common import cutmix_batch

    from mixlabels import TLAlign, TokenLayout

    _, lm = cutmix_batch()
    tracker = TLAlign(layers=[0]).start(lm, TokenLayout(grid=(4, 4), num_prefix=0, depth=2, class_token=False))
    assert isinstance(tracker, CompactTracker)
    with pytest.raises(ValueError, match=r"residual_by\(layer=1.*labels_for\(1\) is None"):
        tracker.residual_by(1, None, lambda y, share: y)
    tracker.residual_by(0, None, lambda y, share: y * 0 + share)  # aligned: the map's answer, as the caller made it
    assert torch.equal(tracker.labels_for(0), torch.full_like(tracker.labels_for(0), 0.5))


@pytest.mark.parametrize("family", ["convnext", "resnet"])
def test_folded_residuals_stay_fp32_under_autocast(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller's bf16 autocast (a training step's) does not reach the folded maps: their matrices, products and the
    labels' product are fp32, and a conv net's targets (which read weights, not activations) the same bits as without
    autocast."""
    monkeypatch.setattr(_convnet, "_WIDE_GROUP", 1)
    from test_backbones_common import SCHEMES, cutmix_batch

    model = FAMILIES[family].example().train()
    adapted = backbones.adapt(model, SCHEMES["tl_align"])
    images, lm = cutmix_batch()
    folds = _Folds(monkeypatch)
    with launch_routes():
        torch.manual_seed(3)
        plain = adapted(images, lm)
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = adapted(images, lm)
    assert folds.calls > 0
    assert cast.target.dtype == torch.float32
    assert torch.equal(cast.target, plain.target)


PROJECTING = ["resnet", "resnetv2", "senet", "resnest", "regnet", "nfnet", "tresnet", "xception_aligned", "tv_resnet"]
"""Families whose examples have blocks with a projection shortcut on small grids: a strided window and a conv in the
branch (ResNet's basic block), or windows alone (a Bottleneck's strided 3x3 conv between 1x1s), beside the shortcut's
strided 1x1 conv or average pool."""


@pytest.mark.parametrize("family", PROJECTING)
@pytest.mark.parametrize("scheme", ["tl_align", "tl_no_norm", "tokens_aligned"])
def test_a_projected_block_folded_into_one_matrix_equals_its_pools_and_lerp(family: str, scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU's route a downsampling block on small grids is one product with ``lerp(S, B, s)`` (the shortcut's
    window matrix, the branch's matrices' product): the targets (and token targets) of the pools, products and
    ``lerp``, and the reference's."""
    monkeypatch.setattr(_convnet, "_WIDE_GROUP", 1)
    folds = _Folds(monkeypatch, "projected_by")
    folded, unfolded = _folded_and_fallback(FAMILIES[family].example(), scheme, folds, "projection")
    assert_close(folded.target, unfolded.target, rtol=1e-6, atol=1e-6)
    if unfolded.token_target is not None:
        assert folded.token_target is not None
        assert_close(folded.token_target, unfolded.token_target, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("plant", ["branch alone", "shortcut alone"])
def test_a_projection_folded_without_one_path_fails_the_family_check(plant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the block's map made of the branch's matrices alone (the shortcut's mean forgotten), or of the
    shortcut's, gives other targets than the reference's."""
    real = _convnet.projected_map

    def forgetful(branch: list[Tensor], shortcut: list[Tensor], share: float, scale: float = 1.0) -> Tensor:
        return real(branch, shortcut, 1.0 if plant == "branch alone" else 0.0, scale)

    monkeypatch.setattr(_convnet, "projected_map", forgetful)
    monkeypatch.setattr(_convnet, "_WIDE_GROUP", 1)
    folds = _Folds(monkeypatch, "projected_by")
    model = FAMILIES["resnet"].example()
    with launch_routes(), pytest.raises(AssertionError):
        _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), "tl_align")
    assert folds.calls > 0


def test_a_projected_map_is_the_lerp_of_the_shortcut_and_the_branchs_product() -> None:
    g = torch.Generator().manual_seed(0)
    first, second, third = (torch.rand(r, c, generator=g) for r, c in ((9, 16), (9, 9), (9, 9)))
    short = torch.rand(9, 16, generator=g)
    for share in (0.5, 1.0):
        assert_close(_convnet.projected_map([first], [short], share), torch.lerp(short, first, share))
        assert_close(_convnet.projected_map([first, second], [short], share), torch.lerp(short, second @ first, share))
        assert_close(_convnet.projected_map([first, second, third], [short], share), torch.lerp(short, third @ second @ first, share))
        assert_close(_convnet.projected_map([first], [short[:, :16], second], share), torch.lerp(second @ short, first, share))
        for scale in (0.25, 2.0**-20):  # labels left at 2^k by summed residuals: the map by 2^-k, exactly
            for branch in ([first], [first, second]):
                exact = _convnet.projected_map(branch, [short], share)
                assert torch.equal(_convnet.projected_map(branch, [short], share, scale), exact * scale)


def test_no_projection_folds_where_a_sample_dropped_its_branch_or_off_a_gpus_route() -> None:
    from test_backbones_common import cutmix_batch

    from mixlabels import TLAlign, TokenLayout

    _, lm = cutmix_batch()
    tracker = TLAlign().start(lm, TokenLayout(grid=(4, 4), num_prefix=0, depth=2, class_token=False))
    labels = tracker.labels_for(0)
    assert labels is not None
    assert not _convnet.projected_route(tracker, labels, None)  # the CPU's eager route: the digest's bits
    with launch_routes():
        assert _convnet.projected_route(tracker, labels, None)
        assert not _convnet.projected_route(tracker, labels, torch.tensor([True, False]))  # a dropped branch
        with _convnet.folded_residuals(False):
            assert not _convnet.projected_route(tracker, labels, None)


def test_projected_by_refuses_a_layer_the_scheme_does_not_align_and_merges_the_unaligned_labels() -> None:
    from test_backbones_common import cutmix_batch

    from mixlabels import TLAlign, TokenLayout

    _, lm = cutmix_batch()
    layout = TokenLayout(grid=(4, 4), num_prefix=0, depth=2, class_token=False)
    tracker = TLAlign(layers=[0]).start(lm, layout)
    assert isinstance(tracker, CompactTracker)
    with pytest.raises(ValueError, match=r"projected_by\(layer=1.*labels_for\(1\) is None"):
        tracker.projected_by(1, lambda y: y, lambda y, share, scale: y)
    tracker.projected_by(0, lambda y: y * 0, lambda y, share, scale: y * 0 + share)  # aligned: the map's answer
    assert torch.equal(tracker.labels_for(0), torch.full_like(tracker.labels_for(0), 0.5))


def test_a_gpus_readout_is_the_mean_without_renormalisation_and_sums_to_one() -> None:
    """Where every operator is a launch the readout's rows are left as the mean made them (two launches fewer): a
    distribution to rounding; the CPU's eager route renormalises (the digest's bits)."""
    from mixlabels._rules import Rules

    g = torch.Generator().manual_seed(0)
    y = torch.rand(3, 5, 4, generator=g)
    y = y / y.sum(-1, keepdim=True)
    rules = Rules(align=frozenset({0}), normalize=True)
    plain = rules.readout(y, "mean", 1, renormalise=False)
    assert torch.equal(plain, y[:, 1:].mean(dim=1))
    renormalised = rules.readout(y, "mean", 1)
    assert torch.equal(renormalised, plain / plain.sum(-1, keepdim=True))
    assert_close(plain.sum(-1), torch.ones(3))
    model = FAMILIES["resnet"].example()
    with launch_routes():
        gpu, _, _ = _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), "tl_align")
    cpu, _, _ = _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), "tl_align")
    assert_close(gpu.target.sum(-1), torch.ones(gpu.target.shape[0]), rtol=0, atol=1e-6)
    assert_close(gpu.target, cpu.target, rtol=1e-6, atol=1e-6)
