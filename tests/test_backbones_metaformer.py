"""The MetaFormer adapter (PoolFormer, ConvFormer, CAFormer): preservation, fast = reference, the pooling rule."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch, sharpen
from timm.layers.norm import GroupNorm1
from timm.models.metaformer import Attention, LayerNorm2dNoBias, LayerNormNoBias, MetaFormer, Pooling, SepConv
from torch.testing import assert_close

from mixlabels import NoAlign, TLAlign, TransMix, backbones
from mixlabels.backbones.families.metaformer import _pooling_matrix, pooling_mix

# Three stages on 32 px: 8x8, 4x4, 2x2 tokens. "caformer" has all three token mixers.
CONFIGS: dict[str, dict[str, Any]] = {
    "poolformer_v1": {"token_mixers": Pooling, "norm_layers": GroupNorm1, "layer_scale_init_values": 1.0,
                      "res_scale_init_values": None, "use_mlp_head": False, "downsample_norm": None},
    "poolformer_v2": {"token_mixers": Pooling, "norm_layers": GroupNorm1},
    "convformer": {"token_mixers": SepConv},
    "caformer": {"token_mixers": (Pooling, SepConv, Attention),
                 "norm_layers": (GroupNorm1, LayerNorm2dNoBias, LayerNormNoBias), "head_dim": 8},
}  # fmt: skip


def make(config: str, drop_path_rate: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MetaFormer(num_classes=C, depths=(2, 1, 2), dims=(8, 16, 32), drop_path_rate=drop_path_rate, **CONFIGS[config])
    return sharpen(model)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("caformer", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["poolformer_v1", "poolformer_v2", "convformer"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tl_align")


def test_explicit_attention_and_mixtoken_fast_equal_reference() -> None:
    model = make("caformer", drop_path_rate=0.2)
    for mod in model.modules():
        if hasattr(mod, "fused_attn"):
            mod.fused_attn = False
    check_parity(model, "tokens_aligned")
    check_parity(make("caformer", drop_path_rate=0.2), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("caformer"), POOLED)


def test_pooling_rule() -> None:
    """Norm(|P - I|): half on the token itself, half spread over the other in-grid taps; 1x1 grid: identity."""
    y = torch.rand(2, 12, 3)
    y = y / y.sum(-1, keepdim=True)
    matrix = _pooling_matrix((3, 4), 3)
    assert_close(torch.diagonal(matrix), torch.full((12,), 0.5, dtype=torch.float64))
    assert_close(matrix[0, [1, 4, 5]], torch.full((3,), 1 / 6, dtype=torch.float64))  # a corner: 3 other taps
    assert_close(matrix[5, [0, 1, 2, 4, 6, 8, 9, 10]], torch.full((8,), 1 / 16, dtype=torch.float64))  # inside
    assert_close(pooling_mix(y, (3, 4), 3), (matrix.float() @ y))
    assert_close(pooling_mix(y[:, :1], (1, 1), 3), y[:, :1])
    assert_close(_pooling_matrix((1, 1), 3), torch.ones(1, 1, dtype=torch.float64))


def test_timm_names_adapt_and_refusals() -> None:
    for name in ("poolformer_s12", "poolformerv2_s12", "convformer_s18", "caformer_s18"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert next(f for f in backbones.FAMILIES if f.name == "metaformer").refusal(model) is None, name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("poolformer_v2"), TransMix())(images, lm)
    odd = make("poolformer_v2")
    odd.stages[0].blocks[0].token_mixer.pool = torch.nn.AvgPool2d(3, 1, 1, count_include_pad=True)
    with pytest.raises(TypeError, match="stage 0 block 0's pooling is not"):
        backbones.adapt(odd, TLAlign())
    maxpooled = MetaFormer(num_classes=C, depths=(1,), dims=(8,), global_pool="max")
    with pytest.raises(TypeError, match="global_pool='max' has no label readout"):
        backbones.adapt(maxpooled, TLAlign())
    assert type(backbones.adapt(maxpooled, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier

