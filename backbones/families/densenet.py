"""Adapter for timm's DenseNet (DenseNet-121/161/169/201/264d, the blur-pool variant).

The label rules of ``backbones._convnet`` on DenseNet's dense blocks. Units after the stem, in
order: every ``DenseLayer`` (one layer each) and every ``DenseTransition``:

- a dense layer appends its output (norm, 1x1 conv, norm, stride-1 3x3 conv) to the block's running
  concatenation: the new map's labels are the concatenation's channel-weighted labels before it
  (its input's channels, then the new ``growth_rate`` ones mixed by the 3x3's normalised |kernel|,
  border-renormalised): ``Parallel`` branches, the identity and the layer's path. A dense layer has
  no sum with its input, so it forms every position from its branches alone: ``aggregate``;
- a transition (norm, 1x1 conv, 2x2 average pool or blur pool) aggregates over its windows;
- the stem (7x7 or deep 3x3 convs, max pool, optionally blur pool) starts from the pixels (a
  MixToken map on its grid);
- readout: ``pool("mean", 0)``, after the final norm: global average pooling, dropout, classifier.

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from timm.models.densenet import DenseBlock, DenseLayer, DenseNet, DenseTransition
from torch import Tensor, nn

from mixlabels.backbones._convnet import AdaptedConvNet, Parallel, Path, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedDenseNet", "DENSENET_FAMILY", "densenet_refusal"]

DENSENET_FAMILY = (
    "timm DenseNet: every position a token; a dense layer's output joins the block's running concatenation, so the "
    "labels join weighed by channel count; stride-1 3x3 convs mix labels by the (out, in)-averaged normalised "
    "|kernel| (border-renormalised); pools and strided convs aggregate over their windows; 1x1 convs, norms, "
    "activations, dropout as channel ops; stem from the pixels; global average pooling"
)


def _split(m: Any) -> tuple[list[nn.Module], list[nn.Module]]:
    """``features`` as the stem's modules and the units after it (dense layers, transitions, the final norm)."""
    stem: list[nn.Module] = []
    units: list[nn.Module] = []
    for module in m.features:
        if isinstance(module, DenseBlock):
            units.extend(module.values())
        elif units or isinstance(module, DenseTransition):
            units.append(module)
        else:
            stem.extend(conv_norm_act_ops(module))
    return stem, units


def _layer_modules(layer: Any) -> list[nn.Module]:
    return [layer.norm1, layer.conv1, layer.norm2, layer.conv2]


def densenet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm DenseNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not DenseNet:
        return f"{type(model).__name__} is not a timm DenseNet"
    m: Any = model
    if m.global_pool.pool_type != "avg" or not isinstance(m.classifier, (nn.Linear, nn.Identity)):
        return f"the head (global_pool={m.global_pool.pool_type!r}) has no label readout; use 'avg' and a linear classifier"
    stem, units = _split(m)
    why = path_refusal(stem, "the stem")
    if why is not None:
        return why
    for i, unit in enumerate(units):
        where = f"unit {i} ({type(unit).__name__})"
        if type(unit) is DenseLayer:
            why = path_refusal(_layer_modules(unit), where)
        elif type(unit) is DenseTransition:
            why = path_refusal(list(unit), where)
        else:
            why = path_refusal([unit], where)
            if why is None and path_of([unit]):
                why = f"{where} after the last dense block is not a channel op"
        if why is not None:
            return why
    return None


class AdaptedDenseNet(AdaptedConvNet):
    """A timm DenseNet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = DENSENET_FAMILY
    refusal = staticmethod(densenet_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        return _split(self.model)[0]

    def _blocks(self) -> list[nn.Module]:
        return _split(self.model)[1]

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) is DenseLayer

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """A dense layer on the running concatenation ``x`` (timm concatenates the same maps, in the same order, once
        per layer), its output appended; any other unit as itself."""
        if type(blk) is DenseLayer:
            return torch.cat([x, blk([x])], dim=1), None
        return blk(x), None

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is DenseLayer:
            layer: Any = blk  # the running concatenation's channels, then the layer's new ones
            new = path_of(_layer_modules(layer))
            return (Parallel.concat([(), new], [int(layer.conv1.in_channels), int(layer.conv2.out_channels)]),), None
        return path_of(list(blk) if isinstance(blk, nn.Sequential) else [blk]), None

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.classifier(m.head_drop(rearrange(x, "b c h w -> b (h w) c")))  # type: ignore[no-any-return]


FAMILY = Family(
    name="densenet",
    description=DENSENET_FAMILY,
    refusal=AdaptedDenseNet.refusal,
    build=AdaptedDenseNet,
    example=tiny(DenseNet, growth_rate=4, block_config=(2, 2, 1), bn_size=2),
    timm_modules=("densenet",),
    speed_model="densenet121",
)
