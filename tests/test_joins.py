"""Fused joins (``backbones._joins``): branches that are each the identity or one stride-1 conv, joined by channel
shares, as one grouped convolution on a GPU's route (and a CPU's on grids up to 28x28).

These tests hold the fused join to the float64 rule ``sum_i s_i Norm(T(k_i)) Y`` (explicit matrices) over kernel
shapes, grids and shares; the kernels of many joins made together to equal each join's own; a real InceptionNeXt's
targets on the GPU's route and the CPU's to the reference path and to the branch-by-branch walk; the route to be taken
only where it is meant to be (a GPU's eager walk, a CPU's on small grids, not on large ones, not a compiled graph); and
its operators to be three a join.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import timm
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_backbones_common import B, C, POOLED, SCHEMES, check_parity, cutmix_batch
from torch import nn
from torch.testing import assert_close

from benchmarks._op_counter import OpCounter
from mixlabels import backbones
from mixlabels.backbones import _convnet, _joins
from mixlabels.backbones._common import launch_routes
from mixlabels.backbones._convnet import Kernels, Parallel
from mixlabels.backbones._dense import conv_matrix, row_normalise
from mixlabels.backbones._joins import fused_join, fused_join_route, fused_joins, join_masses, join_shares, window_kernels
from mixlabels.backbones._windows import as_grid, as_tokens

_SHAPES = [(3, 3), (1, 5), (5, 1), (1, 1), (3, 5), (7, 7)]


def _rule(y: torch.Tensor, grid: tuple[int, int], kernels: list[torch.Tensor | None], shares: list[float]) -> torch.Tensor:
    """``sum_i s_i Norm(T(k_i)) Y`` in float64 by explicit matrices (``None``: the identity), ``(b, n, l)``."""
    n = grid[0] * grid[1]
    total = torch.zeros(n, n, dtype=torch.float64)
    for k, s in zip(kernels, shares):
        if k is None:
            total += s * torch.eye(n, dtype=torch.float64)
        else:
            m, _ = conv_matrix(grid, k.double(), padding=(k.shape[0] // 2, k.shape[1] // 2))
            total += s * row_normalise(m)
    return total @ y.double()


def _fused(y: torch.Tensor, grid: tuple[int, int], kernels: list[torch.Tensor | None], shares: list[float]) -> torch.Tensor:
    """The fused join of one join, built as ``Kernels.join`` builds it, ``(b, n, l)``."""
    shape = tuple(None if k is None else (int(k.shape[0]), int(k.shape[1])) for k in kernels)
    stacks = [None if k is None else k[None] for k in kernels]
    unscaled = window_kernels(shape, stacks, 1, y.device)
    scaled = unscaled * join_shares((tuple(shares),), y.device)
    l, (_, r, kh, kw) = int(y.shape[-1]), scaled.shape
    weight = scaled.unsqueeze(1).expand(1, l, r, kh, kw).reshape(l * r, 1, kh, kw)
    return as_tokens(fused_join(as_grid(y, grid), weight, join_masses(unscaled, grid)[0]))


@settings(max_examples=40, deadline=None)
@given(
    picks=st.lists(st.sampled_from([None, *_SHAPES]), min_size=2, max_size=5), h=st.integers(1, 9), w=st.integers(1, 9),
    l=st.integers(1, 3), seed=st.integers(0, 999),
)
def test_fused_join_is_the_weighted_sum_of_the_normalised_branches(
    picks: list[tuple[int, int] | None], h: int, w: int, l: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    kernels = [None if p is None else torch.rand(p, generator=g) + 0.01 for p in picks]
    raw = torch.rand(len(picks), generator=g) + 0.1
    shares = (raw / raw.sum()).tolist()
    y = torch.rand(3, h * w, l, generator=g)
    y = y / y.sum(-1, keepdim=True)
    got = _fused(y, (h, w), kernels, shares)
    assert got.dtype == torch.float32
    assert_close(got.double(), _rule(y, (h, w), kernels, shares), rtol=1e-6, atol=1e-6)
    assert_close(got.sum(-1), torch.ones(3, h * w))


def test_a_kernel_centred_wrongly_or_a_share_dropped_fails_the_rule() -> None:
    """The rule's check can fail: a band kernel one column off the window's centre, or the shares left out, each
    miss it."""
    g = torch.Generator().manual_seed(0)
    band = torch.rand(1, 5, generator=g)
    kernels: list[torch.Tensor | None] = [None, torch.rand(3, 3, generator=g), band]
    shares = [0.5, 0.3, 0.2]
    y = torch.rand(2, 36, 2, generator=g)
    y = y / y.sum(-1, keepdim=True)
    want = _rule(y, (6, 6), kernels, shares)
    assert_close(_fused(y, (6, 6), kernels, shares).double(), want, rtol=1e-6, atol=1e-6)

    def run(unscaled: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
        weight = scaled.unsqueeze(1).expand(1, 2, 3, 3, 5).reshape(6, 1, 3, 5)
        return as_tokens(fused_join(as_grid(y, (6, 6)), weight, join_masses(unscaled, (6, 6))[0])).double()

    shape = (None, (3, 3), (1, 5))
    unscaled = window_kernels(shape, [None, kernels[1][None], band[None]], 1, y.device)  # type: ignore[index]
    shares_t = join_shares((tuple(shares),), y.device)
    assert_close(run(unscaled, unscaled * shares_t), want, rtol=1e-6, atol=1e-6)
    moved = unscaled.clone()
    moved[0, 2] = torch.roll(unscaled[0, 2], -1, dims=-1)  # the band one column left of the centre
    assert (run(moved, moved * shares_t) - want).abs().max() > 1e-3
    assert (run(unscaled, unscaled).sum(-1) - 1).abs().max() > 0.5  # shares left out: rows sum to 3


def _model(config: str = "atto") -> nn.Module:
    torch.manual_seed(0)
    name = "inception_next_tiny" if config == "tiny" else "inception_next_atto"
    model: nn.Module = timm.create_model(name, pretrained=False, depths=(1, 1, 2, 1), dims=(8, 16, 24, 32), num_classes=C,
                                         ls_init_value=1.0, drop_path_rate=0.4)
    return model


class _Spy:
    """Counts ``fused_join``'s calls in ``_convnet`` (where the walk calls it)."""

    def __init__(self) -> None:
        self.calls = 0
        self._real = _convnet.fused_join

    def __enter__(self) -> _Spy:
        def spy(*args: Any) -> torch.Tensor:
            self.calls += 1
            return self._real(*args)

        _convnet.fused_join = spy  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        _convnet.fused_join = self._real  # type: ignore[assignment]


@pytest.mark.parametrize("scheme", POOLED)
def test_inception_next_on_a_gpus_route_equals_the_reference(scheme: str) -> None:
    with launch_routes(), _Spy() as spy:
        check_parity(_model(), scheme)
    assert spy.calls > 0 or scheme in ("none", "tokens"), "the fused route never ran: this test checked nothing new"


@pytest.mark.parametrize("config", ["atto", "tiny"])
def test_inception_next_fused_equals_the_branch_walk(config: str) -> None:
    """The same targets as the branch-by-branch walk (the CPU's route) to rounding, on the fused route: every join
    fused, and the kernels of all joins made together (one stack a shape) equal to each join's own."""
    model = backbones.adapt(_model(config), SCHEMES["tokens_aligned"]).train()
    images, lm = cutmix_batch()
    torch.manual_seed(1)
    with fused_joins(False):
        walked = model(images, lm)
    with launch_routes(), _Spy() as spy:
        torch.manual_seed(1)
        fused = model(images, lm)
    assert spy.calls == 5  # one join a block
    assert_close(fused.target, walked.target, rtol=1e-6, atol=1e-6)
    assert fused.token_target is not None and walked.token_target is not None
    assert_close(fused.token_target, walked.token_target, rtol=1e-6, atol=1e-6)
    adapted: Any = model
    joins = [j for blk in adapted.model.modules() if hasattr(blk, "token_mixer") for j in _convnet.path_joins(adapted._paths(blk)[0])]
    assert len(joins) == 5
    convs = [c for j in joins for b in j.branches for c in b]
    together, alone = Kernels(convs, joins), Kernels(convs)
    with launch_routes():
        for j in joins:
            for grid in ((4, 4), (2, 2)):
                a, b = together.join(j, grid, 2), alone.join(j, grid, 2)
                assert a is not None and b is not None
                assert_close(a[0], b[0], rtol=0, atol=0)
                assert_close(a[1], b[1], rtol=0, atol=0)


def test_the_route_is_a_gpus_eager_walk_and_a_cpus_on_small_grids() -> None:
    cpu = torch.device("cpu")
    assert fused_join_route(cpu, (28, 28)) and fused_join_route(cpu, (7, 7))
    assert not fused_join_route(cpu, (29, 28)) and not fused_join_route(cpu, (56, 56))  # there it keeps its branches
    with launch_routes():
        assert fused_join_route(cpu, (7, 7)) and fused_join_route(cpu, (56, 56))
        with fused_joins(False):  # the fallback a GPU can be told to take (gpu_suite --family-routes joins=walk)
            assert not fused_join_route(cpu, (56, 56)) and not fused_join_route(cpu, (7, 7))
        assert fused_join_route(cpu, (56, 56))
    with fused_joins(False):
        assert not fused_join_route(cpu, (7, 7))
    model = backbones.adapt(_model(), SCHEMES["tl_align"]).train()
    images, lm = cutmix_batch()
    with _Spy() as spy, fused_joins(False):
        model(images, lm)
        with launch_routes():
            model(images, lm)
    assert spy.calls == 0
    for route in (launch_routes(), nullcontext()):  # the GPU's route; the CPU's, every grid of this batch small
        with route, _Spy() as spy:
            model(images, lm)
        assert spy.calls == 5


@pytest.mark.parametrize("scheme", ["tl_align", "tokens_aligned"])
def test_a_cpu_fuses_the_small_grids_and_walks_the_large(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the CPU's limit at 16 positions (28x28 at 224 px: the same split, at a size the reference path builds),
    the first stage's 8x8 grid walks its block's branches and the other four blocks' joins fuse; the targets equal the
    walk's and the reference path's."""
    monkeypatch.setattr(_joins, "_FUSED_CPU_TOKENS", 16)
    model = _model().train()
    images, lm = cutmix_batch()
    adapted = backbones.adapt(model, SCHEMES[scheme])
    with torch.no_grad():
        with _Spy() as spy:
            torch.manual_seed(1)
            fast = adapted(images, lm)
        assert spy.calls == 4
        with fused_joins(False):
            torch.manual_seed(1)
            walked = adapted(images, lm)
        torch.manual_seed(1)
        reference = backbones.adapt(model, SCHEMES[scheme], reference=True)(images, lm)
    for got, want in ((fast.target, walked.target), (fast.token_target, walked.token_target)):
        if want is not None:
            assert got is not None
            assert_close(got, want, rtol=0, atol=1e-6)
    assert_close(fast.target, reference.target.float(), rtol=0, atol=1e-6)


def test_a_fused_join_dispatches_three_computing_operators() -> None:
    """One grouped conv, one division, one sum a join, once the forward's fused weights exist (they are made at the
    first join for all the others)."""
    g = torch.Generator().manual_seed(0)
    convs = [nn.Conv2d(4, 4, k, padding=(k[0] // 2, k[1] // 2), groups=4) for k in ((3, 3), (1, 7), (7, 1))]
    for c in convs:
        nn.init.uniform_(c.weight, generator=g)
    join = Parallel.concat([(), *((c,) for c in convs)], [5, 1, 1, 1])
    kernels = Kernels(convs, [join])
    y = as_grid(torch.full((B, 64, 2), 0.5), (8, 8))
    with launch_routes():
        weight, masses = kernels.join(join, (8, 8), 2) or (None, None)
        assert weight is not None and masses is not None
        with OpCounter() as counter:
            out = fused_join(y, weight, masses)
    assert counter.kernels == 3, counter.ops
    assert_close(out.sum(1), torch.ones(B, 8, 8))


def test_joins_that_do_not_fuse_keep_their_walk() -> None:
    """A branch of two convs, a dilated conv, a window, or a single conv branch: no fused join (``join_shape``)."""
    c3, c5 = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 5, padding=2)
    dilated = nn.Conv2d(2, 2, 3, padding=2, dilation=2)
    kernels = Kernels([c3, c5, dilated])
    assert kernels.join_shape(Parallel.sum([(c3,), (c5,)])) == ((3, 3), (5, 5))
    assert kernels.join_shape(Parallel.sum([(c3, c5), (c5,)])) is None
    assert kernels.join_shape(Parallel.sum([(), (c3,)])) is None  # one conv: the lerp costs what the sum would
    assert kernels.join_shape(Parallel.sum([(dilated,), (c5,)])) is None
    assert kernels.join_shape(Parallel.sum([(_convnet.Window((2, 2), (2, 2), (0, 0)),), (c3,)])) is None
