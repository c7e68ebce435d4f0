"""The LeViT adapter: preservation, fast = reference, the downsample merge, both variants, refusals."""

from __future__ import annotations

import pytest
import test_backbones_common
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from torch.testing import assert_close

from mixlabels import TLAlign, TokenLabelMap, TokenLabeling, TransMix, backbones
from mixlabels.backbones.families.levit import _attend

TINY = {"embed_dim": (16, 32), "key_dim": 4, "num_heads": (2, 2), "depth": (1, 2)}
VARIANTS = ["levit_128s", "levit_conv_128s"]


def make(name: str = "levit_128s", img: int = 32, drop: float = 0.0, stem: str = "s8", distilled: bool = True) -> torch.nn.Module:
    """A tiny LeViT whose attention biases are large (zero at init: attention would hardly move the labels)."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=C, img_size=img, stem_type=stem, drop_path_rate=drop,
                              distilled=distilled, **TINY)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("attention_biases"):
                p.normal_(0.0, 3.0)
    return model


@pytest.mark.parametrize("name", VARIANTS)
def test_function_preservation_train_mode(name: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(name, drop=0.5), SCHEMES[scheme])
    check_preservation(make(name, distilled=False), SCHEMES["tl_align"])


@pytest.mark.parametrize("name", VARIANTS)
def test_function_preservation_eval_mode(name: str) -> None:
    model = make(name).eval()
    images, lm = cutmix_batch()
    assert_close(backbones.adapt(model, TLAlign())(images, lm).output, model(images), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", POOLED)
@pytest.mark.parametrize("name", VARIANTS)
def test_fast_path_equals_reference(name: str, scheme: str) -> None:
    check_parity(make(name, drop=0.4), scheme)


@pytest.mark.parametrize("name", VARIANTS)
def test_fast_path_equals_reference_with_the_16_stem(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_backbones_common, "IMG", 64)  # Stem16: 4x4, then 2x2
    check_parity(make(name, 64, drop=0.4, stem="s16"), "tl_align")
    check_parity(make(name, 64, stem="s16"), "tokens_aligned", token_space=True)
    check_unmixed_is_one_hot(make(name, 64, stem="s16"), ["tl_align", "tokens_aligned"])


@pytest.mark.parametrize("name", VARIANTS)
def test_unmixed_gives_one_hot(name: str) -> None:
    check_unmixed_is_one_hot(make(name), POOLED)


def test_downsample_merge_is_its_attention() -> None:
    """Each subsampled query's labels are its head-mean attention row over the full grid (rows sum to 1)."""
    model = make().eval()
    ds = model.stages[1].downsample.attn_downsample
    x, y = torch.randn(2, 16, 16), torch.rand(2, 16, 3).softmax(-1)
    out, a = _attend(ds, x)
    assert_close(out, ds(x), rtol=0, atol=0)
    assert a.shape == (2, ds.num_heads, 4, 16)
    merged = a.mean(1) @ y
    assert_close(merged.sum(-1), torch.ones(2, 4))
    # the first query sits on token 0 of the 4x4 grid: with a bias peaked there, it takes token 0's labels
    with torch.no_grad():
        ds.attention_biases.zero_()
        ds.attention_biases[:, 0] = 50.0  # offset (0, 0)
    ds.attention_bias_cache = {}
    _, a = _attend(ds, torch.zeros(2, 16, 16))
    assert_close((a.mean(1) @ y)[:, 0], y[:, 0], rtol=1e-4, atol=1e-4)


def test_token_logits_average_to_the_logits() -> None:
    for name in VARIANTS:
        for train in (True, False):
            model = make(name).train(train)
            images, _ = cutmix_batch()
            lm = TokenLabelMap.unmixed(torch.arange(4), C, (32, 32))
            out = backbones.adapt(model, TokenLabeling(beta=0.5))(images, lm)
            assert out.token_logits is not None
            assert_close(out.token_logits.mean(1), out.output, rtol=1e-4, atol=1e-5)


def test_distilled_training_keeps_both_heads() -> None:
    model = make()
    model.set_distilled_training(True)
    images, lm = cutmix_batch()
    out = backbones.adapt(model, TLAlign())(images, lm)
    assert isinstance(out.output, tuple) and len(out.output) == 2
    assert_close(out.logits, out.output[0])


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "levit")
    names = timm.list_models(module="levit")
    assert any("conv" in n for n in names) and any("conv" not in n for n in names)
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
        assert type(backbones.adapt(model, TLAlign())).__name__ == "AdaptedLeViT"
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    with pytest.raises(ValueError, match=r"64x64 images give a 8x8 grid but the model's attention biases were built for 4x4"):
        lm64 = TokenLabelMap.unmixed(torch.arange(4), C, (64, 64))
        backbones.adapt(make(), TLAlign())(torch.randn(4, 3, 64, 64), lm64)
    headless = make()
    headless.reset_classifier(0)
    with pytest.raises(TypeError, match="the head is not a NormLinear classifier"):
        backbones.adapt(headless, TLAlign())
    custom = timm.create_model("levit_128s", pretrained=False, num_classes=C, img_size=32, stem_backbone=torch.nn.Conv2d(3, 16, 16, 16),
                               stem_stride=16, **TINY)
    assert family.refusal(custom) == "the stem is Conv2d (a stem_backbone?); only timm's Stem16 and Stem8 are supported"
    strided = make()
    strided.stem.conv1.linear.padding = "same"
    assert family.refusal(strided) == "the stem's conv 1 uses padding 'same' (zeros); only static zero padding is supported"
    blk = make()
    blk.stages[0].blocks[0].attn = torch.nn.Identity()
    assert family.refusal(blk) == "stage 0 block 0 is LevitBlock with Identity, LevitMlp; only LevitBlock with Attention and LevitMlp is supported"
