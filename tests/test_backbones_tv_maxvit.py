"""The torchvision MaxVit adapter: preservation, fast = reference, partitions as torchvision's, one-hot, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_torchvision_builders, check_unmixed_is_one_hot, cutmix_batch
from torch import nn
from torch.testing import assert_close
from torchvision.models.maxvit import MaxVit, PartitionAttentionLayer, RelativePositionalMultiHeadAttention

from mixlabels import TLAlign, TokenLabelMap, TransMix, backbones
from mixlabels.backbones.families.maxxvit import partition_labels, partition_sizes

FAMILY = next(f for f in backbones.FAMILIES if f.name == "tv_maxvit")

# 32 px images: stem 16x16, then one grid per block
CONFIGS: dict[str, dict[str, Any]] = {
    # grids 8, 4, 2 with 2x2 windows and grids; block 1 has a stride-1 MBConv (identity shortcut)
    "p2": {"partition_size": 2, "block_channels": [8, 16, 32], "block_layers": [1, 2, 1]},
    # grids 8, 4 with 4x4 windows: block 0's grid partition is 2x2 groups of 4x4 dilated tokens
    "p4": {"partition_size": 4, "block_channels": [16, 32], "block_layers": [2, 1]},
}


def make(config: str = "p2", stochastic_depth_prob: float = 0.0) -> nn.Module:
    """A seeded tiny MaxVit. torchvision draws every Linear at std 0.02, which leaves attention near uniform and
    the logits near 0 (a parity test could hardly fail): q, k, the relative position biases and the head are
    redrawn larger."""
    torch.manual_seed(0)
    model = MaxVit(input_size=(32, 32), stem_channels=8, head_dim=8, stochastic_depth_prob=stochastic_depth_prob,
                   num_classes=C, **CONFIGS[config])  # fmt: skip
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RelativePositionalMultiHeadAttention):
                qk = mod.to_qkv.weight[: 2 * mod.to_qkv.out_features // 3]
                qk.copy_(torch.randn(qk.shape, generator=g) * 0.5)
                mod.relative_position_bias_table.copy_(torch.randn(mod.relative_position_bias_table.shape, generator=g))
        model.classifier[-1].weight.copy_(torch.randn(model.classifier[-1].weight.shape, generator=g) * 0.5)
    return model


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(config, stochastic_depth_prob=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(stochastic_depth_prob=0.4), scheme)


def test_fast_path_equals_reference_four_by_four() -> None:
    check_parity(make("p4", stochastic_depth_prob=0.4), "tl_align")


def test_mixtoken_fast_equals_reference() -> None:
    check_parity(make(stochastic_depth_prob=0.2), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(stochastic_depth_prob=0.3), POOLED)


def test_every_builder_adapts() -> None:
    check_torchvision_builders("tv_maxvit")


@pytest.mark.parametrize("config", list(CONFIGS))
def test_labels_are_partitioned_as_torchvision_partitions_tokens(config: str) -> None:
    """Token ids through torchvision's own ``WindowPartition`` (and ``SwapAxes`` for the grid) land where the
    labels' partition puts them: both attentions mix labels over exactly the tokens they attend over."""
    for u in make(config).modules():
        if not isinstance(u, PartitionAttentionLayer):
            continue
        gh, gw = u.grid_size
        ids = torch.arange(gh * gw, dtype=torch.float32)
        theirs = u.partition_swap(u.partition_op(ids.view(1, 1, gh, gw), u.p))  # 1 g p 1
        side = u.attn_layer[1].size
        sizes = partition_sizes((gh, gw), (side, side), u.partition_type == "window", "")
        ours = partition_labels(ids.view(1, -1, 1), (gh, gw), sizes, u.partition_type == "window")  # g p 1
        assert_close(ours, theirs[0], rtol=0, atol=0, msg=f"{u.partition_type} on {gh}x{gw}")


def test_refusals() -> None:
    with torch.device("meta"):
        assert FAMILY.refusal(timm.create_model("maxvit_pico_rw_256")) == "MaxxVit is not a torchvision MaxVit"
        tv = MaxVit(input_size=(224, 224), stem_channels=8, partition_size=7, block_channels=[8], block_layers=[1],
                    head_dim=8, stochastic_depth_prob=0.0)  # fmt: skip
        timm_family = next(f for f in backbones.FAMILIES if f.name == "maxxvit")
        assert timm_family.refusal(tv) == "MaxVit is not a timm MaxxVit"
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    circular = make()
    circular.blocks[1].layers[1].layers.MBconv.layers.conv_b[0].padding_mode = "circular"
    with pytest.raises(TypeError, match="block 1 layer 1's MBConv's branch module 4 .* only static zero padding"):
        backbones.adapt(circular, TLAlign())
    mlp_head = make()
    mlp_head.classifier[4] = nn.ReLU()
    with pytest.raises(TypeError, match="the classifier is not torchvision's"):
        backbones.adapt(mlp_head, TLAlign())
    # a non-square input_size: torchvision's grid partition counts its partitions by the height alone
    wide = MaxVit(input_size=(32, 64), stem_channels=8, partition_size=2, block_channels=[8], block_layers=[1],
                  head_dim=8, stochastic_depth_prob=0.0)  # fmt: skip
    with pytest.raises(TypeError, match="block 0 layer 0's grid attention's grid partition of its 8x16 grid makes 2x4 windows .* square input_size"):
        backbones.adapt(wide, TLAlign())


@pytest.mark.parametrize("size", [(64, 64), (16, 64)])
def test_images_of_another_size_are_refused(size: tuple[int, int]) -> None:
    """The partitions are fixed at construction: 64x64 fails in torchvision, and 16x64 (as many tokens) runs there
    with its windows laid out wrong; the adapter refuses both, naming the size the model was built for."""
    model = make().train()
    images = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(0))
    lm = TokenLabelMap.unmixed(torch.tensor([0, 1]), C, size)
    for reference in (False, True):
        with pytest.raises(ValueError, match="window attention built for 8x8: .* use 32x32 images, or build the model with input_size"):
            backbones.adapt(model, TLAlign(), reference=reference)(images, lm)


def test_reference_refuses_what_would_exhaust_memory() -> None:
    big = TokenLabelMap.unmixed(torch.tensor([0]), C, (512, 512))  # 256x256 stem grid: 128 GiB matrices
    with pytest.raises(ValueError, match="dense reference path would build 128.0 GiB"):
        backbones.adapt(make(), TLAlign(), reference=True)(torch.zeros(1, 3, 512, 512), big)
