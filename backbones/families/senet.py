"""Adapter for timm's legacy SENet class (``legacy_seresnet*``, ``legacy_seresnext*``, ``legacy_senet154``).

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on SENet's blocks.
Events per residual block ``layer`` (blocks counted over the four stages):

- the branch (``SEResNetBlock``: 3x3, 3x3; ``SEResNetBottleneck``: 1x1 (strided: Caffe's placement), 3x3,
  1x1; ``SEResNeXtBottleneck`` and ``SEBottleneck``: 1x1, grouped 3x3 (strided), 1x1), then senet.py's
  own ``SEModule``: a stride-1 3x3 conv mixes labels by its (out, in)-averaged normalised |kernel|
  (border-renormalised), a strided conv aggregates over its windows; 1x1 convs, batch norms, ReLUs and
  the SE gate (it scales each channel by a gate computed from the globally pooled features, the same at
  every position) are channel ops;
- the shortcut: the identity, or ``downsample`` (a 1x1 conv, or senet154's 3x3 stride-2 conv with
  padding 1, then a batch norm) aggregating over its windows; the branch joins by the residual rule
  (SENet has no stochastic depth: every branch kept);
- the stem (``layer0``: a 7x7/2 conv, or senet154's three 3x3 convs, the first strided; then ``pool0``,
  a 3x3/2 max pool with ``ceil_mode``) forms the first tokens from windows of pixels (a MixToken map
  starts on its grid);
- readout: ``pool("mean", 0)`` (global average pooling, then the functional dropout and ``last_linear``;
  no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from einops import rearrange
from timm.models.senet import SEBottleneck, SEModule, SENet, SEResNetBlock, SEResNetBottleneck, SEResNeXtBottleneck
from torch import Tensor, nn

from mixlabels.backbones._convnet import AdaptedConvNet, Path, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedSENet", "SENET_FAMILY", "senet_refusal"]

SENET_FAMILY = (
    "timm legacy SENet (SE-ResNet-18/34/50/101/152, SE-ResNeXt, SENet-154): every position a token; stride-1 3x3 "
    "convs (grouped too) mix labels by the (out, in)-averaged normalised |kernel| (border-renormalised); strided "
    "convs and the stem's max pool aggregate over their windows; 1x1 convs, batch norms, ReLU and senet.py's "
    "SEModule as channel ops; a block's shortcut keeps (or aggregates) the labels and its branch's labels join by "
    "the residual rule; stem from the pixels; global average pooling"
)

_BLOCKS = (SEResNetBlock, SEBottleneck, SEResNetBottleneck, SEResNeXtBottleneck)
_GATES = (SEModule,)  # senet.py's own SE: x * sigmoid(fc2(relu(fc1(mean over h w)))), a per-channel gate


def _branch_modules(blk: Any) -> list[nn.Module]:
    """The branch's modules in the order of timm's ``forward`` (before the sum)."""
    if type(blk) is SEResNetBlock:
        return [blk.conv1, blk.bn1, blk.relu, blk.conv2, blk.bn2, blk.relu, blk.se_module]
    return [blk.conv1, blk.bn1, blk.relu, blk.conv2, blk.bn2, blk.relu, blk.conv3, blk.bn3, blk.se_module]


def _stem_modules(m: Any) -> list[nn.Module]:
    return [*m.layer0, m.pool0]


def _blocks(m: Any) -> list[Any]:
    return [blk for stage in (m.layer1, m.layer2, m.layer3, m.layer4) for blk in stage]


def senet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm legacy SENet this adapter carries labels through (``None``: it is)."""
    if type(model) is not SENet:
        return f"{type(model).__name__} is not a timm legacy SENet"
    m: Any = model
    if m.global_pool.pool_type != "avg":
        return f"global_pool={m.global_pool.pool_type!r} has no label readout; use 'avg'"
    if type(m.last_linear) is not nn.Linear:
        return f"the classifier is {type(m.last_linear).__name__}; only an nn.Linear reads the pooled features here"
    why = path_refusal(_stem_modules(m), "the stem")
    if why is not None:
        return why
    for i, blk in enumerate(_blocks(m)):
        where = f"block {i}"
        if type(blk) not in _BLOCKS:
            return f"{where} is {type(blk).__name__}; only senet.py's {', '.join(b.__name__ for b in _BLOCKS)} are supported"
        why = path_refusal(_branch_modules(blk), f"{where}'s branch", _GATES) or path_refusal(
            conv_norm_act_ops(blk.downsample), f"{where}'s shortcut"
        )
        if why is not None:
            return why
    return None


class AdaptedSENet(AdaptedConvNet):
    """A timm legacy SENet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = SENET_FAMILY
    refusal = staticmethod(senet_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        return _stem_modules(self.model)

    def _blocks(self) -> list[nn.Module]:
        return _blocks(self.model)

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's block forward (no stochastic depth: every branch kept)."""
        h = x
        for module in _branch_modules(blk):
            h = module(h)
        shortcut = blk.downsample(x) if blk.downsample is not None else x
        return blk.relu(h + shortcut), None

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        return path_of(_branch_modules(blk)), path_of(conv_norm_act_ops(blk.downsample))

    def _logits(self, x: Tensor) -> Tensor:
        return self.model.forward_head(x)  # type: ignore[operator, no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        """The classifier on every final position ``(b, h*w, classes)`` (timm's head without the pooling)."""
        m: Any = self.model
        t = rearrange(x, "b c h w -> b (h w) c")
        if m.drop_rate:
            t = F.dropout(t, p=float(m.drop_rate), training=m.training)
        return m.last_linear(t)  # type: ignore[no-any-return]


FAMILY = Family(
    name="senet",
    description=SENET_FAMILY,
    refusal=AdaptedSENet.refusal,
    build=AdaptedSENet,
    example=tiny(SENet, block=SEResNetBlock, layers=(1, 1, 1, 1), groups=1, reduction=16, inplanes=16),
    timm_modules=("senet",),
    speed_model="legacy_seresnet18",
)
