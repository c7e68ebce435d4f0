"""A first unit's leading windows start the labels with the stem's (``backbones._convnet.windows_into_stem``).

Where a stem of windows alone is followed by a unit without shortcut that starts with windows (MobileNetV3's and
StarNet's strided depthwise conv after the strided stem conv), the fast path weighs the mask under the whole chain at
once instead of starting on the stem's grid and averaging over the unit's windows after. Both are the same linear map
(a chain of renormalised window sums), so the targets must agree with the walk that does not move them, and with the
dense reference, to rounding; a unit with a shortcut, a stem that convolves, a branch that starts with a conv and a
token-space (MixToken) map keep the walk as it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import timm
import torch
from torch.testing import assert_close

import mixlabels.backbones._convnet as convnet
import mixlabels.backbones.families.efficientnet as efficientnet
from mixlabels import TLAlign, TokenLabeling, TokenLabelMap, backbones
from mixlabels.backbones._convnet import Window, windows_into_stem

S2 = Window((3, 3), (2, 2), (1, 1))
S1 = Window((3, 3), (1, 1), (1, 1))
POOL = Window((2, 2), (2, 2), (0, 0))


def test_moves_the_leading_windows_of_a_unit_without_shortcut() -> None:
    conv = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4)
    stem, first, grid = windows_into_stem((S2,), ((S2, POOL, conv), None), (64, 64))
    assert stem == (S2, S2, POOL) and grid == (16, 16)  # the stem's 64x64 grid through S2 and POOL
    assert first == ((conv,), None)
    # no stem at all (the labels start on the pixels): the unit's windows start them
    assert windows_into_stem((), ((S2,), None), (8, 8)) == ((S2,), ((), None), (4, 4))


@pytest.mark.parametrize(
    "stem, first",
    [
        ((S2,), ((S2,), ())),  # a shortcut (identity): the unit's labels join the residual's
        ((S2,), ((S2,), (S2,))),  # a downsampling shortcut
        ((S2, torch.nn.Conv2d(3, 3, 3, padding=1)), ((S2,), None)),  # the stem convolves after its windows
        ((S2,), ((torch.nn.Conv2d(3, 3, 3, padding=1), S2), None)),  # the branch starts with a conv
        ((S2,), ((), None)),  # channel ops only
    ],
)
def test_leaves_the_walk_alone_otherwise(stem: Any, first: Any) -> None:
    assert windows_into_stem(stem, first, (64, 64)) == (stem, first, (64, 64))


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    """The windows each forward moved (a spy on both callers' ``windows_into_stem``)."""
    seen: list[tuple[Any, ...]] = []

    def spy(stem: Any, first: Any, grid: Any) -> Any:
        out = windows_into_stem(stem, first, grid)
        seen.append(out[0][len(stem):])  # the windows the stem's path gained
        return out

    monkeypatch.setattr(convnet, "windows_into_stem", spy)
    monkeypatch.setattr(efficientnet, "windows_into_stem", spy)
    yield seen


def _unmoved(stem: Any, first: Any, grid: Any) -> Any:
    return stem, first, grid


def _batch(size: int, token_space: bool = False) -> tuple[torch.Tensor, TokenLabelMap]:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(3, 3, size, size, generator=g)
    mask = torch.ones(3, size, size)
    mask[0, 5:40, 9:50] = 0.0  # boxes cutting through the stem's and the first unit's windows
    mask[1, 20:, :31] = 0.0
    mask[2, 1:7, 3:60] = 0.0
    lm = TokenLabelMap.from_mask(mask, torch.tensor([1, 2, 0]), torch.tensor([3, 7, 5]), num_classes=10,
                                 token_space=token_space)
    return (images if token_space else lm.mix_pixels(images)), lm


MODELS = {
    "mobilenetv3": lambda: timm.create_model("mobilenetv3_small_050", num_classes=10),  # EfficientNet-class walk
    "starnet": lambda: timm.create_model("starnet_s050", num_classes=10),  # AdaptedConvNet's walk
    "selecsls": lambda: next(f for f in backbones.FAMILIES if f.name == "selecsls").example(),  # the registry's tiny model
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("scheme", [TLAlign(), TokenLabeling(beta=0.5, aligned=True)], ids=["tl_align", "tokens_aligned"])
def test_targets_equal_the_walk_without_the_move_and_the_reference(
    name: str, scheme: Any, calls: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = MODELS[name]().train()
    images, lm = _batch(32 if name == "selecsls" else 64)  # the tiny SelecSLS is built for 32 px
    adapted = backbones.adapt(model, scheme)
    with torch.no_grad():
        torch.manual_seed(1)
        moved = adapted(images, lm)
        assert calls and calls[-1], "the first unit's windows were not moved into the stem"
        monkeypatch.setattr(convnet, "windows_into_stem", _unmoved)
        monkeypatch.setattr(efficientnet, "windows_into_stem", _unmoved)
        torch.manual_seed(1)
        walked = adapted(images, lm)
        torch.manual_seed(1)
        reference = backbones.adapt(model, scheme, reference=True)(images, lm)
    assert_close(moved.logits, walked.logits, rtol=0, atol=0)
    for got, want in ((moved.target, walked.target), (moved.token_target, walked.token_target)):
        if want is not None:
            assert_close(got, want, rtol=0, atol=1e-6)
    assert_close(moved.target, reference.target.float(), rtol=0, atol=1e-6)


def test_a_token_space_map_starts_on_the_stems_grid(calls: list[tuple[Any, ...]]) -> None:
    """MixToken mixed the stem's output: its labels start there, and nothing is moved."""
    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", num_classes=10).train()
    images, lm = _batch(64, token_space=True)
    adapted = backbones.adapt(model, TLAlign())
    with torch.no_grad():
        torch.manual_seed(1)
        fast = adapted(images, lm)
        torch.manual_seed(1)
        reference = backbones.adapt(model, TLAlign(), reference=True)(images, lm)
    assert calls == []
    assert_close(fast.target, reference.target.float(), rtol=0, atol=1e-6)
