"""The MaxxVit adapter (MaxViT, CoAtNet, MaxxViT, CoAtNeXt): preservation, fast = reference, names, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch, set_fused, sharpen
from timm.layers.conv2d_same import Conv2dSame
from timm.models.maxxvit import MaxxVit, MaxxVitCfg, MaxxVitConvCfg, MaxxVitTransformerCfg

from mixlabels import NoAlign, TLAlign, TokenLabelMap, TransMix, backbones

# Three stages on 32 px: stem 16x16, then 8x8, 4x4, 2x2 tokens; 2x2 windows and grids.
CONFIGS: dict[str, dict[str, Any]] = {
    # MaxViT-rw: MBConv with a strided depthwise conv, avg2 shortcut, channels-last block + grid attention, CoAtNet stage last
    "maxvit": {"block_type": ("C", "M", "T")},
    # CoAtNet-rw-like: pooled MBConv branch, 3x3/2 max pools, MLP relative positions, the norm-MLP head
    "coatnet": {"block_type": ("C", "C", "T"), "head_hidden_size": 32,
                "conv_cfg": MaxxVitConvCfg(stride_mode="pool", pool_type="max", attn_early=True),
                "transformer": {"pool_type": "max", "rel_pos_type": "mlp", "rel_pos_dim": 16}},
    # MaxxViT v2-like: ConvNeXt conv blocks, NCHW grid-only attention with interleaved heads
    "maxxvit_nchw": {"block_type": ("M", "M", "M"),
                     "conv_cfg": MaxxVitConvCfg(block_type="convnext", pool_type="avg"),
                     "transformer": {"use_nchw_attn": True, "head_first": False, "no_block_attn": True, "init_values": 1e-2}},
    # the paper's stride in the first 1x1 conv
    "mbconv_1x1": {"block_type": ("C", "M", "T"), "conv_cfg": MaxxVitConvCfg(stride_mode="1x1")},
    # TF 'same' padding (maxvit_*_tf_*): Conv2dSame stem and strided depthwise convs, AvgPool2dSame 2x2 shortcuts
    "maxvit_tf": {"block_type": ("C", "M", "T"), "conv_cfg": MaxxVitConvCfg(padding="same", act_layer="gelu_tanh"),
                  "transformer": {"head_first": False, "rel_pos_type": "bias_tf"}},
    # 'same' 3x3/2 MaxPool2dSame on the shortcut and the branch; a strided 1x1 Conv2dSame
    "coatnet_same": {"block_type": ("C", "C", "T"), "conv_cfg": MaxxVitConvCfg(stride_mode="pool", pool_type="max", padding="same")},
    "mbconv_1x1_same": {"block_type": ("C", "M", "T"), "conv_cfg": MaxxVitConvCfg(stride_mode="1x1", padding="same", pool_type="avg")},
}  # fmt: skip
SAME = ["maxvit_tf", "coatnet_same", "mbconv_1x1_same"]  # at 32 px the 3x3/2 windows pad 32, 16, 8 and 4 by (0, 1)


def make(config: str, drop_path_rate: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    kwargs = dict(CONFIGS[config])
    transformer = MaxxVitTransformerCfg(dim_head=8, window_size=(2, 2), **kwargs.pop("transformer", {}))
    cfg = MaxxVitCfg(embed_dim=(8, 16, 32), depths=(1, 1, 1), stem_width=8, transformer_cfg=transformer, **kwargs)
    return sharpen(MaxxVit(cfg, img_size=32, num_classes=C, drop_path_rate=drop_path_rate))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    check_preservation(make(config, drop_path_rate=0.5), SCHEMES["tokens_aligned"])
    check_preservation(set_fused(make(config, drop_path_rate=0.5), False), SCHEMES["tl_align"])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("maxvit", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["coatnet", "maxxvit_nchw", "mbconv_1x1", *SAME])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tl_align")


@pytest.mark.parametrize("scheme", ["tl_official", "tokens_aligned", "tl_first"])
def test_same_padding_fast_path_equals_reference(scheme: str) -> None:
    model = make("maxvit_tf", drop_path_rate=0.4)
    assert {type(m).__name__ for m in model.modules()} >= {"Conv2dSame", "AvgPool2dSame"}
    check_parity(model, scheme)


def test_same_padding_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("coatnet_same"), POOLED)


def test_explicit_attention_and_mixtoken_fast_equal_reference() -> None:
    check_parity(set_fused(make("maxvit", drop_path_rate=0.2), False), "tokens_aligned")
    check_parity(make("maxvit", drop_path_rate=0.2), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("coatnet"), POOLED)


def test_timm_names_adapt() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "maxxvit")
    for name in ("coatnet_pico_rw_224", "coatnet_0_224", "coatnet_bn_0_rw_224", "coatnet_rmlp_1_rw_224", "coatnext_nano_rw_224",
                 "maxvit_pico_rw_256", "maxvit_rmlp_nano_rw_256", "maxxvit_rmlp_nano_rw_256", "maxxvitv2_nano_rw_256"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name


def test_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "maxxvit")
    with torch.device("meta"):
        tf, parallel = timm.create_model("maxvit_tiny_tf_224"), timm.create_model("maxvit_tiny_pm_256")
    assert family.refusal(tf) is None  # TF 'same' padding: windows resolved on each grid
    assert "ParallelMaxxVitBlock (block type 'PM'" in (family.refusal(parallel) or "")
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("maxvit"), TransMix())(images, lm)
    grouped = make("maxvit")
    conv = grouped.stages[0].blocks[0].conv2_kxk
    grouped.stages[0].blocks[0].conv2_kxk = torch.nn.Conv2d(conv.in_channels, conv.out_channels, 3, 2, 1, groups=2)
    with pytest.raises(TypeError, match="stage 0 block 0's depthwise conv is a grouped"):
        backbones.adapt(grouped, TLAlign())
    even = make("maxvit_tf")  # a stride-1 'same' conv with an even kernel pads one side more: no rule
    even.stem.conv2 = Conv2dSame(8, 8, 2)
    with pytest.raises(TypeError, match=r"the stem's conv2 is a Conv2dSame of stride \(1, 1\).*use conv_padding=''"):
        backbones.adapt(even, TLAlign())
    maxpooled = make("maxvit")
    maxpooled.reset_classifier(C, global_pool="max")
    with pytest.raises(TypeError, match="global_pool='max' has no label readout"):
        backbones.adapt(maxpooled, TLAlign())
    assert type(backbones.adapt(maxpooled, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier
    g = torch.Generator().manual_seed(0)
    odd = torch.randn(2, 3, 40, 40, generator=g)  # stage 1: a 5x5 grid, which 2x2 windows do not tile
    with pytest.raises(ValueError, match="not divisible by the 2x2"):
        backbones.adapt(make("maxvit"), TLAlign())(odd, TokenLabelMap.unmixed(torch.tensor([0, 1]), C, (40, 40)))


def test_reference_refuses_what_would_exhaust_memory() -> None:
    big = TokenLabelMap.unmixed(torch.tensor([0]), C, (512, 512))  # 256x256 stem grid: 128 GiB matrices
    with pytest.raises(ValueError, match="dense reference path would build 128.0 GiB"):
        backbones.adapt(make("maxvit"), TLAlign(), reference=True)(torch.zeros(1, 3, 512, 512), big)
