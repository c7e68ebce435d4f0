"""Adapter for timm's MobileNetV4 (the MobileNetV3 class with ``head_norm``): conv and hybrid models.

Built on the ``mobilenetv3`` family (``families/mobilenetv3.py``): the same EfficientNet blocks and
pooled readout, plus UniversalInvertedResidual blocks and the hybrids' MobileAttention (rules in
``families/efficientnet.py``); what differs is the head's ``norm_head``, which per-position logits
apply with the pooled batch's statistics.

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.models import _efficientnet_builder
from timm.models.mobilenetv3 import MobileNetV3
from torch import Tensor, nn

from mixlabels.backbones._convnet import path_of, path_refusal
from mixlabels.backbones._family import Family
from mixlabels.backbones.families.efficientnet import blocks_refusal
from mixlabels.backbones.families.mobilenetv3 import AdaptedMobileNetV3

__all__ = ["AdaptedMobileNetV4", "MOBILENETV4_FAMILY", "mobilenetv4_refusal", "tiny_mobilenetv4"]

MOBILENETV4_FAMILY = (
    "timm MobileNetV4 (mobilenetv4_conv_* and _hybrid_*: the MobileNetV3 class with head_norm): UniversalInvertedResidual "
    "blocks (optional depthwise convs before, between and after the 1x1s: each mixes labels by its normalised "
    "|kernel|, or aggregates when strided; 1x1s, norms, layer scale as channel ops), EdgeResidual and ConvBnAct; "
    "the hybrids' MobileAttention (multi-query attention: key/value labels summed over the strided depthwise conv's "
    "windows, moved by the head-mean attention rows); avg and blur anti-aliasing pools aggregate; global average "
    "pooling, then conv_head and norm_head on the pooled vector (channel ops; per-position logits normalised by the "
    "pooled batch's statistics); stochastic depth"
)


def mobilenetv4_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm MobileNetV4 (the MobileNetV3 class with ``head_norm``) this adapter carries labels
    through (``None``: it is)."""
    if type(model) is not MobileNetV3:
        return f"{type(model).__name__} is not a timm MobileNetV3 class (MobileNetV4)"
    m: Any = model
    if isinstance(m.norm_head, nn.Identity):
        return "no norm_head: a MobileNetV3-style head (the mobilenetv3 family takes it)"
    if not isinstance(m.norm_head, nn.BatchNorm2d):
        return f"norm_head is {type(m.norm_head).__name__}; only a batch norm (timm's BatchNormAct2d) is supported"
    if m.global_pool.pool_type != "avg":
        return f"global_pool={m.global_pool.pool_type!r} has no label readout; use 'avg'"
    why = blocks_refusal(m) or path_refusal([m.conv_head, m.act2], "the head")
    if why is None and path_of([m.conv_head]):
        return "the head's conv_head is not a 1x1 stride-1 convolution"
    return why


class AdaptedMobileNetV4(AdaptedMobileNetV3):
    """A timm MobileNetV4 conv model returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = MOBILENETV4_FAMILY
    refusal = staticmethod(mobilenetv4_refusal)

    def _position_logits(self, x: Tensor) -> Tensor:
        """timm's head on every position, ``(b, h*w, classes)``: ``norm_head`` normalises each position's
        ``conv_head`` features by the statistics timm's pooled pass used (the batch's pooled vectors in
        training, the running ones in eval), without updating the running statistics a second time."""
        m: Any = self.model
        norm = m.norm_head
        t = m.conv_head(x)  # b c h w
        if norm.training or norm.running_mean is None:
            pooled = m.conv_head(m.global_pool(x))  # b c 1 1, what timm's norm_head saw
            mean, var = pooled.mean(dim=(0, 2, 3)), pooled.var(dim=(0, 2, 3), unbiased=False)
        else:
            mean, var = norm.running_mean, norm.running_var
        shape = (1, -1, 1, 1)  # by hand: batch statistics carry gradients, which F.batch_norm's buffers may not
        t = (t - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + norm.eps)
        if norm.affine:
            t = t * norm.weight.reshape(shape) + norm.bias.reshape(shape)
        t = rearrange(m.act2(norm.act(norm.drop(t))), "b c h w -> b (h w) c")
        if m.drop_rate > 0.0:
            t = F.dropout(t, p=m.drop_rate, training=m.training)
        return m.classifier(t)  # type: ignore[no-any-return]


def tiny_mobilenetv4(num_classes: int = 10, **kwargs: Any) -> MobileNetV3:
    """A seeded MobileNetV4-style model for 32x32 images (grids 16, 8, 4, 4, 2): head_norm, layer scale, every
    UniversalInvertedResidual variant timm's models use (ExtraDW, IB, ConvNeXt-like, FFN, a strided ``dw_start``)
    after an EdgeResidual, and the hybrids' MobileAttention on the 4x4 grid (keys/values on a 2x2 grid, then on the
    full grid). ``kwargs`` go to ``MobileNetV3`` (``drop_path_rate``, ``aa_layer``, ...)."""
    torch.manual_seed(0)
    arch = [["er_r1_k3_s2_e2_c8"], ["uir_r1_a3_k5_s2_e2_c16", "uir_r1_a3_k3_s1_e2_c16"],
            ["uir_r1_a0_k3_s1_e2_c16", "uir_r1_a3_k0_s1_e2_c16", "uir_r1_a0_k0_s1_e2_c16",
             "mqa_r1_k3_h2_s1_v2_d8_c16", "mqa_r1_k3_h2_s1_d8_c16", "uir_r1_a3_k0_s1_e2_c16"],  # timm: no stage ends on MQA
            ["uir_r1_a5_k0_s2_e2_c24", "uir_r1_a3_k3_s1_e2_c24"], ["cn_r1_k1_s1_c32"]]  # fmt: skip
    decode: Any = _efficientnet_builder.decode_arch_def  # untyped in timm
    return MobileNetV3(decode(arch), num_classes=num_classes, stem_size=8, fix_stem=True, num_features=32, head_norm=True,
                       head_bias=False, layer_scale_init_value=1e-5, **kwargs)  # fmt: skip


FAMILY = Family(
    name="mobilenetv4",
    description=MOBILENETV4_FAMILY,
    refusal=AdaptedMobileNetV4.refusal,
    build=AdaptedMobileNetV4,
    example=tiny_mobilenetv4,
    timm_modules=("mobilenetv3",),
    speed_model="mobilenetv4_conv_small",
)
