"""The GCViT adapter: preservation, fast = reference (local and global-query windows, MBConv mixes), refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import B, C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch, sharpen
from timm.models.gcvit import GlobalContextVit

from mixlabels import TLAlign, TokenLabeling, TokenLabelMap, TransMix, backbones

BASE: dict[str, Any] = dict(img_size=32, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 2), num_classes=C)
FAMILY = next(f for f in backbones.FAMILIES if f.name == "gcvit")


def make(drop_path_rate: float = 0.0, **kwargs: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GlobalContextVit(drop_path_rate=drop_path_rate, **{**BASE, **kwargs})  # timm's variants pin depths
    return sharpen(model)


def test_local_and_global_blocks_are_exercised() -> None:
    model: Any = make()
    assert [blk.attn.use_global for stage in model.stages for blk in stage.blocks] == [False, True] * 2
    assert len(model.stages[0].global_block.blocks) == 2  # MBConv + pool: the 8x8 map pooled to the 4x4 window


@pytest.mark.parametrize("scheme", ["none", "tl_align", "tokens_aligned"])
def test_function_preservation_train_mode(scheme: str) -> None:
    check_preservation(make(drop_path_rate=0.5), SCHEMES[scheme])


def test_function_preservation_layer_scale_and_attention_dropout() -> None:
    check_preservation(make(drop_path_rate=0.3, layer_scale=0.5, attn_drop_rate=0.2), SCHEMES["tl_align"])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


def test_mixtoken_dropout_and_fused_route_fast_equal_reference() -> None:
    check_parity(make(drop_path_rate=0.2), "tokens_aligned", token_space=True)
    check_parity(make(drop_path_rate=0.2, attn_drop_rate=0.3), "tl_align")
    with torch.no_grad():  # without gradients: one fused SDPA call with the bias as its mask
        check_parity(make(drop_path_rate=0.4), "tl_align")


def test_global_query_attention_equals_timm_and_mixes_within_windows() -> None:
    """The global query is its image's, shared by that image's windows; each row mixes its window's tokens."""
    from mixlabels.backbones.families.gcvit import _window_attention

    model: Any = make()
    attn = model.stages[0].blocks[1].attn
    g = torch.Generator().manual_seed(0)
    x, q_global = torch.randn(2 * 4, 16, 16, generator=g), torch.randn(2, 4, 4, 16, generator=g)
    x[1], x[4] = x[0], x[0]  # window 1: same image, same tokens; window 4: another image, same tokens
    y = torch.eye(16).repeat(8, 1, 1)  # every window token its own label: mixed = the attention rows
    with torch.no_grad():
        out, mixed = _window_attention(attn, x, q_global, y)
        torch.testing.assert_close(out, attn(x, q_global), rtol=1e-5, atol=1e-5)  # fused kernel vs explicit matrix
    assert mixed is not None
    torch.testing.assert_close(mixed.sum(-1), torch.ones(8, 16))
    torch.testing.assert_close(mixed[1], mixed[0])
    assert (mixed[4] - mixed[0]).abs().max() > 1e-3  # the other image's global query


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_timm_names_adapt_and_refusals() -> None:
    for name in ("gcvit_xxtiny", "gcvit_tiny", "gcvit_base"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    lm48 = TokenLabelMap.unmixed(torch.arange(B), C, (48, 48))  # 12x12 then 6x6 tokens: windows of 4 do not tile
    with pytest.raises(ValueError, match="not divisible by its 4x4 windows"):
        backbones.adapt(make(), TokenLabeling())(torch.randn(B, 3, 48, 48), lm48)
    lm64 = TokenLabelMap.unmixed(torch.arange(B), C, (64, 64))  # tiles the windows, but the global query is 8x8
    with pytest.raises(ValueError, match="the global query map is 8x8 for 4x4 windows"):
        backbones.adapt(make(), TokenLabeling())(torch.randn(B, 3, 64, 64), lm64)
    with pytest.raises(TypeError, match="only global average pooling"):
        backbones.adapt(make(global_pool="max"), TLAlign())
    pooled: Any = make()
    pooled.stages[1].downsample.reduction = torch.nn.MaxPool2d(3, 2, 1)
    with pytest.raises(TypeError, match="stage 1's downsampling reduces with MaxPool2d; only the strided conv"):
        backbones.adapt(pooled, TLAlign())
    dense: Any = make()
    dense.stem.down.conv_block.conv_dw = torch.nn.Conv2d(16, 16, 3, 1, 1)
    with pytest.raises(TypeError, match="the stem's downsampling's MBConv conv_dw must be a stride-1 depthwise"):
        backbones.adapt(dense, TLAlign())
    model: Any = make()
    model.set_grad_checkpointing(True)
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        backbones.adapt(model, TokenLabeling())(images, lm)
