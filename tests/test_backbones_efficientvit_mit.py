"""The EfficientViT (MIT) adapter: preservation, fast = reference, the linear-attention label rule, refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import test_backbones_common
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from torch.testing import assert_close

from mixlabels import NoAlign, TLAlign, TransMix, backbones
from mixlabels.backbones._common import conv_mix
from mixlabels.backbones.families.efficientvit_mit import _v_kernels, head_conv_mix, linear_attention_labels, value_kernels

CONFIGS = {
    # B series on 32 px: stem 16x16, stages 8x8, 4x4, then LiteMLA on 2x2 (on 4x4 with 64 px images)
    "b": ("efficientvit_b0", {"widths": (8, 16, 16, 32), "depths": (1, 2, 1, 2), "head_dim": 8, "head_widths": (32, 32)}),
    # L series: ConvBlock stem, FusedMBConv stages (full convs), MBConv and LiteMLA last
    "l": ("efficientvit_l1", {"widths": (8, 8, 16, 16, 32), "depths": (1, 1, 1, 1, 1), "head_dim": 8, "head_widths": (32, 32)}),
}


def make(config: str) -> torch.nn.Module:
    torch.manual_seed(0)
    name, kwargs = CONFIGS[config]
    return timm.create_model(name, pretrained=False, num_classes=C, **kwargs)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config), SCHEMES[scheme])


def test_function_preservation_eval_mode() -> None:
    model = make("b").eval()
    images, lm = cutmix_batch()
    assert_close(backbones.adapt(model, TLAlign())(images, lm).output, model(images), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("b"), scheme)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fast_path_equals_reference_on_larger_grids(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """64 px images: LiteMLA runs on 4x4 (B) and 2x2 (L) grids, its 5x5 value convs cut by the border."""
    monkeypatch.setattr(test_backbones_common, "IMG", 64)
    check_parity(make(config), "tl_align")
    check_parity(make(config), "tokens_aligned", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("b"), POOLED)


@pytest.mark.parametrize("ones_column", [True, False])
def test_linear_attention_rule(ones_column: bool) -> None:
    """Rows are the exactly normalised relu(q).relu(k) weights, averaged over heads; a zero row keeps the token's labels.
    Both ways of forming the row sums (a ones column on the values, eager's; the keys' sum, a compiled graph's)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.rand(2, 3, 6, 4, generator=g), torch.rand(2, 3, 6, 4, generator=g)
    q[0, 1, 2] = 0.0  # head 1 of token 2 attends to nothing
    y = torch.rand(2, 6, 5, generator=g).softmax(-1)
    values = torch.rand(2, 3, 6, 5, generator=g).softmax(-1)
    w = q @ k.transpose(-1, -2)
    rows = w / w.sum(-1, keepdim=True)
    expected = rows @ values
    expected[0, 1, 2] = y[0, 2]
    got = linear_attention_labels(q, k, values, y, ones_column)
    assert_close(got, expected.mean(1))
    assert_close(got.sum(-1), torch.ones(2, 6))
    if ones_column:  # eager's default
        assert torch.equal(linear_attention_labels(q, k, values, y), got)


def test_value_kernels_of_many_convs_equal_each_convs_own() -> None:
    """``value_kernels`` reduces the value channels of every conv of one head dim and kernel size in one stack: each
    conv's kernels are ``_v_kernels``' (the reference's definition), bit for bit and in order, with two head dims and
    two kernel sizes interleaved."""
    g = torch.Generator().manual_seed(0)
    specs = [(8, 5, 4), (4, 5, 2), (8, 3, 4), (8, 5, 6), (4, 5, 3)]  # (head dim, kernel size, heads)
    convs = []
    for d, k, heads in specs:
        c = 3 * d * heads
        conv = torch.nn.Conv2d(c, c, k, padding=k // 2, groups=c, bias=False)
        with torch.no_grad():
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=g))
            conv.weight[2 * d] = 0.0  # head 0's first value channel all zeros: its sum clamped, its share 0
        convs.append((d, conv))
    got = value_kernels(convs)
    assert len(got) == len(specs)
    for (d, conv), kernels, (_, k, heads) in zip(convs, got, specs):
        assert kernels.shape == (heads, 1, k, k)  # the layout F.conv2d reads
        assert torch.equal(kernels[:, 0], _v_kernels(SimpleNamespace(dim=d), conv, torch.float32))


def test_head_conv_mix_is_conv_mix_per_head() -> None:
    g = torch.Generator().manual_seed(0)
    y = torch.rand(2, 20, 3, generator=g).softmax(-1)
    kernels = torch.rand(4, 1, 5, 5, generator=g)
    got = head_conv_mix(y, (4, 5), kernels, (2, 2), (1, 1))
    for h in range(4):
        assert_close(got[:, h], conv_mix(y, (4, 5), kernels[h, 0], (2, 2), (1, 1)))


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "efficientvit_mit")
    for name in timm.list_models(module="efficientvit_mit"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("b"), TransMix())(images, lm)
    gelu = make("b")
    mla = gelu.stages[2].blocks[1].context_module.main
    mla.kernel_func = torch.nn.GELU()
    with pytest.raises(TypeError, match="LiteMLA kernel_func is GELU; only ReLU"):
        backbones.adapt(gelu, TLAlign())
    strided = make("b")
    strided.stages[0].blocks[1].main.depth_conv.conv.stride = (2, 2)
    with pytest.raises(TypeError, match="stage 0 block 1 is a residual block with a strided conv"):
        backbones.adapt(strided, TLAlign())
    same = make("b")
    same.stem.res0.main.depth_conv.conv.padding = "same"
    with pytest.raises(TypeError, match="stem block 0's spatial conv uses padding 'same'"):
        backbones.adapt(same, TLAlign())
    maxpooled = make("b")
    maxpooled.reset_classifier(C, global_pool="max")
    with pytest.raises(TypeError, match="global_pool='max' has no label readout"):
        backbones.adapt(maxpooled, TLAlign())
    assert type(backbones.adapt(maxpooled, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier
