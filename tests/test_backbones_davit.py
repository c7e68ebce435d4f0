"""The DaViT adapter: preservation, fast = reference, channel attention as a channel op, refusals, timm names."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import B, C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch, set_fused, sharpen

from mixlabels import TLAlign, TokenLabeling, TokenLabelMap, TransMix, backbones

BASE: dict[str, Any] = dict(depths=(1, 1), embed_dims=(16, 32), num_heads=(2, 2), window_size=4, num_classes=C)
FAMILY = next(f for f in backbones.FAMILIES if f.name == "davit")


def make(drop_path_rate: float = 0.0, fused: bool = True, **kwargs: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("davit_tiny", pretrained=False, drop_path_rate=drop_path_rate, **{**BASE, **kwargs})
    return sharpen(set_fused(model, fused))


def test_every_block_kind_is_exercised() -> None:
    model: Any = make()
    kinds = [type(blk).__name__ for stage in model.stages for pair in stage.blocks for blk in pair]
    assert kinds == ["SpatialBlock", "ChannelBlock"] * 2
    assert type(model.stages[1].downsample).__name__ == "Downsample"


@pytest.mark.parametrize("scheme", ["none", "tl_align", "tokens_aligned"])
def test_function_preservation_train_mode(scheme: str) -> None:
    check_preservation(make(drop_path_rate=0.5), SCHEMES[scheme])


def test_function_preservation_variants() -> None:
    """Explicit attention, channel attention v2, GELU in the position encodings, norm-first head."""
    check_preservation(make(drop_path_rate=0.3, fused=False, channel_attn_v2=True, cpe_act=True), SCHEMES["tl_align"])
    check_preservation(make(drop_path_rate=0.3, head_norm_first=True, down_kernel_size=3), SCHEMES["tokens_aligned"])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


def test_variants_and_mixtoken_fast_equal_reference() -> None:
    check_parity(make(drop_path_rate=0.2, fused=False, channel_attn_v2=True, cpe_act=True), "tl_align")
    check_parity(make(drop_path_rate=0.2, head_norm_first=True, down_kernel_size=3), "tokens_aligned")
    check_parity(make(drop_path_rate=0.2), "tokens_aligned", token_space=True)


def test_channel_attention_leaves_labels_alone() -> None:
    """Rescrambling the channel attention changes the logits but not the labels the channel blocks
    (layers 1 and 3) align; rescrambling the spatial attention moves the spatial blocks' (0 and 2)."""
    images, lm = cutmix_batch()
    targets: dict[str, torch.Tensor] = {}
    for changed in ("none", "channel", "spatial"):
        model: Any = make()
        with torch.no_grad():
            for stage in model.stages:
                for pair in stage.blocks:
                    blk = pair[1] if changed == "channel" else pair[0]
                    if changed != "none":
                        blk.attn.qkv.weight.mul_(6.0).add_(torch.randn_like(blk.attn.qkv.weight))
        for kind, layers in (("spatial", (0, 2)), ("channel", (1, 3))):
            out = backbones.adapt(model, TLAlign(layers=layers))(images, lm)
            targets[f"{changed}-{kind}"] = out.target
        targets[f"{changed}logits"] = out.logits
    assert (targets["channellogits"] - targets["nonelogits"]).abs().max() > 1e-3
    torch.testing.assert_close(targets["channel-channel"], targets["none-channel"], rtol=1e-5, atol=1e-6)
    assert (targets["channel-spatial"] - targets["none-spatial"]).abs().max() > 1e-4  # layer 2 sees new tokens
    assert (targets["spatial-spatial"] - targets["none-spatial"]).abs().max() > 1e-4


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_timm_names_adapt_and_refusals() -> None:
    for name in ("davit_tiny", "davit_small", "davit_base_fl"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    odd = make(window_size=3)  # stage 0: 8x8 tokens, windows of 3 would pad
    with pytest.raises(ValueError, match="not divisible by its 3x3 windows"):
        backbones.adapt(odd, TokenLabeling())(images, lm)
    lm40 = TokenLabelMap.unmixed(torch.arange(B), C, (40, 40))  # 10x10 tokens: windows of 4 would pad
    with pytest.raises(ValueError, match="not divisible by its 4x4 windows"):
        backbones.adapt(make(), TokenLabeling())(torch.randn(B, 3, 40, 40), lm40)
    with pytest.raises(TypeError, match="only global average pooling"):
        backbones.adapt(make(global_pool="max"), TLAlign())
    swapped: Any = make()
    swapped.stages[0].blocks[0][0].cpe1.proj = torch.nn.Conv2d(16, 16, 3, padding=1)
    with pytest.raises(TypeError, match="stage 0 block 0's cpe1 must be a stride-1 depthwise convolution"):
        backbones.adapt(swapped, TLAlign())
    replaced: Any = make()
    replaced.stages[1].blocks[0][1] = torch.nn.Identity()
    with pytest.raises(TypeError, match="stage 1 block 1 is Identity; only DaViT's SpatialBlock and ChannelBlock"):
        backbones.adapt(replaced, TLAlign())
    model: Any = make()
    model.set_grad_checkpointing(True)
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        backbones.adapt(model, TokenLabeling())(images, lm)
