"""The EfficientViT (MSRA) adapter: preservation, fast = reference, the cascade rule, windows, refusals."""

from __future__ import annotations

import pytest
import test_backbones_common
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.efficientvit_msra import ResidualDrop
from torch.testing import assert_close

from mixlabels import TLAlign, TokenLabeling, TransMix, backbones
from mixlabels.backbones.families.efficientvit_msra import _window_attention

TINY = {"embed_dim": (16, 32), "key_dim": (4, 4), "depth": (1, 1), "num_heads": (2, 2), "down_ops": (("", 1), ("subsample", 2))}
# 64 px: a 4x4 patch grid in 2x2 windows, then subsampled to 2x2 (one window) and 1x1.
WINDOWED = {"embed_dim": (16, 32, 32), "key_dim": (4, 4, 4), "depth": (2, 1, 1), "num_heads": (4, 2, 2),
            "window_size": (2, 2, 2), "down_ops": (("", 1), ("subsample", 2), ("subsample", 2))}  # fmt: skip


def make(img: int = 32, drop: float = 0.0) -> torch.nn.Module:
    """A tiny model whose attention biases are large (zero at init: attention would be near uniform) and
    whose ResidualDrops drop with ``drop`` (timm builds them all with 0)."""
    torch.manual_seed(0)
    model = timm.create_model("efficientvit_m0", pretrained=False, num_classes=C, img_size=img, **(TINY if img == 32 else WINDOWED))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("attention_biases"):
                p.normal_(0.0, 3.0)
    for mod in model.modules():
        if isinstance(mod, ResidualDrop):
            mod.drop = drop
    return model


def test_function_preservation_train_mode() -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(drop=0.5), SCHEMES[scheme])


def test_function_preservation_eval_mode() -> None:
    model = make().eval()
    images, lm = cutmix_batch()
    assert_close(backbones.adapt(model, TLAlign())(images, lm).output, model(images), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop=0.4), scheme)


def test_fast_path_equals_reference_in_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_backbones_common, "IMG", 64)
    check_parity(make(64, drop=0.4), "tl_align")
    check_parity(make(64), "tokens_aligned", token_space=True)
    check_unmixed_is_one_hot(make(64), ["tl_align", "tokens_aligned"])


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_cascade_rule() -> None:
    """Head 0 mixes Y; head i mixes (Y + Z_{i-1}) / 2; the branch is the heads' mean, row-stochastic."""
    model = make(64)
    lwa = model.stages[0].blocks[0].mixer.m
    x, y = torch.randn(2, 16, 4, 4), torch.rand(2, 16, 3).softmax(-1)
    _, mixed = _window_attention(lwa, x, y, (4, 4))
    assert mixed is not None
    assert_close(mixed.sum(-1), torch.ones(2, 16))
    # one window (tokens 0, 1, 4, 5): its labels depend on those tokens' labels only
    y2 = y.clone()
    y2[:, [2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]] = torch.rand(2, 12, 3).softmax(-1)
    assert_close(_window_attention(lwa, x, y2, (4, 4))[1][:, [0, 1, 4, 5]], mixed[:, [0, 1, 4, 5]])  # type: ignore[index]


def test_token_logits_average_to_the_logits() -> None:
    """The head per position uses the pooled features' batch statistics: its mean over positions is the output."""
    for train in (True, False):
        model = make(64).train(train)
        images, lm = cutmix_batch()
        images = torch.nn.functional.interpolate(images, size=64)
        lm64 = type(lm).unmixed(torch.arange(4), C, (64, 64))
        out = backbones.adapt(model, TokenLabeling(beta=0.5))(images, lm64)
        assert out.token_logits is not None
        assert_close(out.token_logits.mean(1), out.output, rtol=1e-4, atol=1e-5)


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "efficientvit_msra")
    for name in timm.list_models(module="efficientvit_msra"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    padded = make(64)
    padded.stages[0].blocks[0].mixer.m.attn.set_resolution(3)  # a 4x4 grid in 3x3 windows would be padded
    lm64 = type(lm).unmixed(torch.arange(4), C, (64, 64))
    with pytest.raises(ValueError, match="4x4 grid is no multiple of the 3x3 attention window"):
        backbones.adapt(padded, TLAlign())(torch.randn(4, 3, 64, 64), lm64)
    strided = make()
    strided.stages[0].blocks[0].dw0.m.conv.stride = (2, 2)
    with pytest.raises(TypeError, match="stage 0 block 0 dw0's conv must be a stride-1 depthwise convolution"):
        backbones.adapt(strided, TLAlign())
    headless = timm.create_model("efficientvit_m0", pretrained=False, num_classes=0, img_size=32, **TINY)
    with pytest.raises(TypeError, match="the head is not a NormLinear classifier"):
        backbones.adapt(headless, TLAlign())
