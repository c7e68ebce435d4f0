"""Adapter for timm's MobileNetV3 class (MobileNetV3 large/small/rw, FBNetV3, LCNet, HardCoRe-NAS).

The stem and blocks are EfficientNet's (``timm.models._efficientnet_blocks``), so the events
are ``AdaptedEfficientNet``'s (``backbones.families.efficientnet``): per block, a stride-1 depthwise
or full kxk conv mixes labels by its channel-averaged normalised |kernel|, a strided one
aggregates, 1x1 convs, norms, hard-swish and the hard-sigmoid squeeze-excite gates are
channel ops; a skip block joins by the residual rule, a block without one aggregates.

What differs is the "efficient head": global average pooling comes FIRST, then the 1x1
``conv_head`` and its activation on the pooled vector. A per-sample channel op after the
pool leaves the pooled labels alone, so the readout is ``pool("mean", 0)`` on the last
block's map. Per-position logits (token-labelling schemes) run the same head on every
position of that map.

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.models._efficientnet_blocks import SqueezeExcite
from timm.models import _efficientnet_builder
from timm.models.mobilenetv3 import MobileNetV3
from torch import Tensor, nn

from mixlabels.backbones._convnet import path_of, path_refusal
from mixlabels.backbones.families.efficientnet import AdaptedEfficientNet, blocks_refusal
from mixlabels.backbones._family import Family

__all__ = [
    "AdaptedMobileNetV3",
    "MOBILENETV3_FAMILY",
    "mobilenetv3_refusal",
    "tiny_mobilenetv3",
    "conv_head_position_logits",
]

MOBILENETV3_FAMILY = (
    "timm MobileNetV3 class (MobileNetV3 large/small/rw, FBNetV3, LCNet, HardCoRe-NAS; tf_* with TF 'same' padding): "
    "EfficientNet's InvertedResidual, DepthwiseSeparable, EdgeResidual and ConvBnAct blocks and rules (stride-1 kxk "
    "convs mix by the channel-averaged normalised |kernel|, strided convs aggregate, 1x1 convs, hard-swish and "
    "squeeze-excite as channel ops); global average pooling before the 1x1 conv_head, a channel op on the pooled "
    "vector; stochastic depth"
)


def mobilenetv3_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm MobileNetV3 this adapter carries labels through (``None``: it is)."""
    if type(model) is not MobileNetV3:
        return f"{type(model).__name__} is not a timm MobileNetV3"
    m: Any = model
    if m.global_pool.pool_type != "avg":
        return f"global_pool={m.global_pool.pool_type!r} has no label readout; use 'avg'"
    if not isinstance(m.norm_head, nn.Identity):
        return "norm_head (head_norm=True) is MobileNetV4's head: the mobilenetv4 family takes it"
    why = blocks_refusal(m) or path_refusal([m.conv_head, m.act2], "the head")
    if why is None and path_of([m.conv_head]):
        return "the head's conv_head is not a 1x1 stride-1 convolution"
    return why


class AdaptedMobileNetV3(AdaptedEfficientNet):
    """A timm MobileNetV3 returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = MOBILENETV3_FAMILY
    refusal = staticmethod(mobilenetv3_refusal)

    def _pre_pool(self, x: Tensor) -> Tensor:
        return x  # the pool reads the last block's map; the head runs after it (in forward_head)

    def _position_logits(self, x: Tensor) -> Tensor:
        return conv_head_position_logits(self.model, x)


def conv_head_position_logits(m: Any, x: Tensor) -> Tensor:
    """A pool-then-``conv_head`` head (MobileNetV3's, GhostNet's: 1x1 conv, activation, dropout, classifier) on every
    position rather than the pooled map: ``(b, h*w, classes)``."""
    t = rearrange(m.act2(m.conv_head(x)), "b c h w -> b (h w) c")
    if m.drop_rate > 0.0:
        t = F.dropout(t, p=m.drop_rate, training=m.training)
    return m.classifier(t)  # type: ignore[no-any-return]


def tiny_mobilenetv3(num_classes: int = 10, **kwargs: Any) -> MobileNetV3:
    """A seeded MobileNetV3 for 32x32 images (grids 16, 16, 8, 4): timm's variants reach a 1x1 grid there.

    Hard-swish, hard-sigmoid squeeze-excite as in ``mobilenetv3_large_100``; blocks: DepthwiseSeparable
    (skip), InvertedResidual (strided, then with skip), EdgeResidual (skip), ConvBnAct. ``kwargs`` go to
    ``MobileNetV3`` (``drop_path_rate``, ``drop_rate``, ...). The arch is decoded per call: timm's builder
    consumes its block arguments.
    """
    torch.manual_seed(0)
    arch = [["ds_r1_k3_s1_e1_c8_se0.25_nre"], ["ir_r1_k3_s2_e3_c16_nre", "ir_r1_k3_s1_e3_c16_se0.25"],
            ["ir_r1_k5_s2_e3_c24_se0.25", "er_r1_k3_s1_e2_c24"], ["cn_r1_k1_s1_c32"]]  # fmt: skip
    se = partial(SqueezeExcite, gate_layer="hard_sigmoid", force_act_layer=nn.ReLU)
    decode: Any = _efficientnet_builder.decode_arch_def  # untyped in timm
    return MobileNetV3(decode(arch), num_classes=num_classes, stem_size=8, fix_stem=True, num_features=32,
                       act_layer=nn.Hardswish, se_layer=se, **kwargs)  # fmt: skip


FAMILY = Family(
    name="mobilenetv3",
    description=MOBILENETV3_FAMILY,
    refusal=AdaptedMobileNetV3.refusal,
    build=AdaptedMobileNetV3,
    example=tiny_mobilenetv3,
    timm_modules=("mobilenetv3", "hardcorenas"),
    speed_model="mobilenetv3_small_100",
)
