"""The fork/join event (``LabelTracker.fork``, ``join``) held by numbers computed by hand, on both trackers.

A concatenation of a part that ran through layers and a part that waited weighs each part by its channel
count: ``Norm((1 - share) Y + share Norm(M Y_fork))``. Two tokens on a 1x2 grid, two sources: token 0 is the
sample's own, token 1 its partner's (sample 0: classes 0 and 1; sample 1, its partner sample 0: classes 1 and 0).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from mixlabels import NoAlign, Scheme, TLAlign, TokenLabeling, TokenLabelMap, TokenLayout
from mixlabels._rules import Rules
from mixlabels._trackers import DenseTracker

LAYOUT = TokenLayout(grid=(1, 2), num_prefix=0, depth=1, class_token=False)
UNIFORM = torch.full((2, 2), 0.5)  # the residual branch's spatial mix: both tokens read both
SWAP = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # the waiting part's own map: each token reads the other


def t(rows: object) -> Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def label_map() -> TokenLabelMap:
    mask = torch.zeros(2, 1, 2)
    mask[:, :, 0] = 1.0  # the left token from the sample itself
    return TokenLabelMap.from_mask(mask, torch.tensor([1, 0]), torch.tensor([0, 1]), num_classes=2)


def classes(token0: list[float]) -> Tensor:
    """Source weights ``[own, partner]`` of a token as the two samples' class distributions."""
    return t([token0, token0[::-1]])


def test_join_weighs_the_parts_by_channels() -> None:
    y, forked = t([[[0.75, 0.25]]]), t([[[1.0, 0.0]]])
    assert_close(Rules().join(y, forked, 0.25, keep=None), t([[[0.8125, 0.1875]]]))  # 3/4 of y, 1/4 of the fork
    assert_close(Rules().join(y, 2 * forked, 0.25, keep=None), t([[[0.8125, 0.1875]]]))  # the fork's merge renormalised
    assert_close(Rules().join(y, forked, 0.0, keep=None), y)
    two, fork2 = t([[[0.75, 0.25]], [[0.75, 0.25]]]), t([[[1.0, 0.0]], [[1.0, 0.0]]])
    keep = torch.tensor([True, False])  # sample 1's forked part was dropped (zeros): its labels stay
    assert_close(Rules().join(two, fork2, 0.5, keep), t([[[0.875, 0.125]], [[0.75, 0.25]]]))
    assert_close(Rules(follow_drop=False).join(two, fork2, 0.5, keep), t([[[0.875, 0.125]], [[0.875, 0.125]]]))
    with pytest.raises(ValueError, match=r"channel fraction, in \[0, 1\]; got 1.5"):
        Rules().join(y, forked, 1.5, keep=None)
    # rows that sum to 1 already: the same numbers without the renormalisations, the drop rule kept
    assert_close(Rules().join(y, forked, 0.25, keep=None, normalised=True), t([[[0.8125, 0.1875]]]))
    assert_close(Rules().join(two, fork2, 0.5, keep, normalised=True), t([[[0.875, 0.125]], [[0.75, 0.25]]]))


def test_a_normalised_join_reads_the_same_targets() -> None:
    swap = lambda y: torch.einsum("nm,bml->bnl", SWAP, y)  # noqa: E731
    for first in (0, 1):  # source weights
        assert_close(compact(TLAlign(), swap, first, normalised=True)[0], compact(TLAlign(), swap, first)[0])
    # annotator maps whose cells sum to less than 1, and unequally: the tracker starts them as distributions
    # (``mixed_token_targets(distributions=True)``), so leaving the renormalisations out changes rounding only
    maps = t([[[[0.5, 0.0], [0.2, 0.6]]], [[[0.0, 0.25], [0.3, 0.4]]]])  # b h w c
    lm = label_map().with_token_targets(maps)
    for first in (0, 1):
        kept = compact(TokenLabeling(aligned=True), swap, first, normalised=True, lm=lm)[1]
        renormalised = compact(TokenLabeling(aligned=True), swap, first, lm=lm)[1]
        assert kept is not None and renormalised is not None
        assert_close(kept, renormalised)


def compact(
    scheme: Scheme, merge: Callable[[Tensor], Tensor] | None, first: int, *, normalised: bool = False, lm: TokenLabelMap | None = None,
) -> tuple[Tensor, Tensor | None]:
    """fork, a residual whose branch mixes uniformly, join by 1/4; the target read at token ``first``."""
    tracker = scheme.start(label_map() if lm is None else lm, LAYOUT)
    fork = tracker.fork()
    labels = tracker.labels_for(0)
    tracker.residual(0, None, mixed=None if labels is None else torch.einsum("nm,bml->bnl", UNIFORM, labels))
    tracker.join(fork, 0.25, merge=merge, normalised=normalised)
    tracker.pool("token", first)
    out = tracker.finish()
    return out.target, out.token_target


def dense(scheme: Scheme, matrix: Tensor | None, first: int) -> tuple[Tensor, Tensor | None]:
    tracker = DenseTracker.start(scheme, label_map(), LAYOUT)
    fork = tracker.fork()
    tracker.mix(0, UNIFORM, keep=None)
    tracker.join(fork, 0.25, matrix)
    out = tracker.result(torch.zeros(2, 2), torch.zeros(2, 2), "token", None, first)
    return out.target, out.token_target


@pytest.mark.parametrize("walk", ["compact", "dense"])
def test_both_trackers_join_by_hand(walk: str) -> None:
    def run(scheme: Scheme, swap: bool, first: int) -> tuple[Tensor, Tensor | None]:
        if walk == "compact":
            return compact(scheme, (lambda y: torch.einsum("nm,bml->bnl", SWAP, y)) if swap else None, first)
        return dense(scheme, SWAP if swap else None, first)

    # the residual: (Y + U Y) / 2 = [[.75, .25], [.25, .75]]; joined with 1/4 of the forked labels
    assert_close(run(TLAlign(), False, 0)[0], classes([0.8125, 0.1875]))
    assert_close(run(TLAlign(), False, 1)[0], classes([0.1875, 0.8125]))
    # the forked part through its own map (the tokens swapped): 3/4 [.75, .25] + 1/4 [0, 1]
    assert_close(run(TLAlign(), True, 0)[0], classes([0.5625, 0.4375]))
    # token labeling with aligned labels runs the same rules
    assert_close(run(TokenLabeling(aligned=True), True, 0)[0], classes([0.5625, 0.4375]))
    # unaligned token targets (the input labels, merged only) join too: 3/4 Y + 1/4 swap(Y)
    _, tokens = run(TokenLabeling(), True, 0)
    assert tokens is not None
    assert_close(tokens, torch.stack([classes([0.75, 0.25]), classes([0.25, 0.75])], dim=1))
    # the image target of an unaligned scheme never moves
    assert_close(run(NoAlign(), True, 0)[0], classes([0.5, 0.5]))


def test_a_join_across_an_aggregate_is_refused_by_both_trackers() -> None:
    def halve(y: Tensor) -> Tensor:
        return y.sum(dim=1, keepdim=True)  # the two tokens merged into one

    tracker = TLAlign().start(label_map(), LAYOUT)
    fork = tracker.fork()
    tracker.aggregate(halve)
    with pytest.raises(ValueError, match=r"lie on different grids \(an aggregate ran between fork and join\)"):
        tracker.join(fork, 0.5)
    tracker.join(fork, 0.5, merge=halve)  # the forked part merged alike: the same grid
    ref = DenseTracker.start(TLAlign(), label_map(), LAYOUT)
    fork = ref.fork()
    ref.aggregate(torch.ones(1, 2))
    with pytest.raises(ValueError, match="lie on different grids"):
        ref.join(fork, 0.5)
