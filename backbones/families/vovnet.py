"""Adapter for timm's VoVNet (VoVNet-39/57, ESE-VoVNet, their depthwise and slim variants).

The label rules of ``backbones._convnet`` on VoVNet's one-shot-aggregation (OSA) blocks. Units
after the stem, in order: each stage's max pool (a window aggregation, not a layer), then its
``OsaBlock``\\ s, one layer each:

- an ``OsaBlock`` concatenates its input with the output of every conv of a chain (the
  depthwise variants reduce the width by a 1x1 conv first), then a 1x1 conv and a channel gate
  (effective SE or ECA). The concatenation is ``Parallel`` branches weighed by their channel
  counts: the identity (the block's input channels), then the chain's prefixes, each conv's
  stride-1 3x3 (full, or depthwise then pointwise) mixing labels by its (out, in)-averaged
  normalised |kernel|;
- a residual block (a stage's later blocks) joins the concatenation's labels to its input's by
  the residual rule, with its drop path; a stage's first block has no shortcut and forms every
  position from its branch: its labels ``aggregate``. (timm applies such a block's drop path to
  its whole output, zeroing a dropped sample's map: its positions still come from the same windows,
  so the labels follow them alike.)
- the stem (3x3 convs, strided ones aggregating) starts from the pixels (a MixToken map on its grid);
- readout: ``pool("mean", 0)``, timm's ``ClassifierHead`` with average pooling.

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from typing import Any

from einops import rearrange
from timm.layers.classifier import ClassifierHead
from timm.layers.drop import DropPath
from timm.models.vovnet import OsaBlock, OsaStage, VovNet
from torch import Tensor, nn

from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import AdaptedConvNet, Parallel, Path, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedVovNet", "VOVNET_FAMILY", "vovnet_refusal", "classifier_head_refusal", "HeadedConvNet"]

VOVNET_FAMILY = (
    "timm VoVNet (VoVNet, ESE-VoVNet, depthwise and slim variants): every position a token; a one-shot aggregation "
    "block concatenates its input and every conv of its chain, so their labels join weighed by channel count; "
    "stride-1 3x3 convs mix labels by the (out, in)-averaged normalised |kernel| (border-renormalised); max pools "
    "and strided convs aggregate over their windows; 1x1 convs, norms, activations, ESE/ECA as channel ops; a "
    "residual block's labels join its input's by the residual rule; stem from the pixels; global average pooling; "
    "stochastic depth"
)


def classifier_head_refusal(head: nn.Module) -> str | None:
    """Why a timm ``ClassifierHead`` has no label readout (``None``: average pooling then a linear layer)."""
    if type(head) is not ClassifierHead:
        return f"the head is {type(head).__name__}, not timm's ClassifierHead"
    h: Any = head
    if h.global_pool.pool_type != "avg" or h.use_conv or not isinstance(h.fc, (nn.Linear, nn.Identity)):
        return f"the head (global_pool={h.global_pool.pool_type!r}, use_conv={h.use_conv}) has no label readout; use 'avg' and a linear fc"
    return None


def classifier_head_positions(head: Any, x: Tensor) -> Tensor:
    """A timm ``ClassifierHead``'s classifier on every position ``(b, h*w, classes)`` (its pooling left out)."""
    t = rearrange(x, "b c h w -> b (h w) c")
    return head.fc(head.drop(t))  # type: ignore[no-any-return]


def _units(m: Any) -> list[nn.Module]:
    return [unit for stage in m.stages for unit in ([stage.pool] if stage.pool is not None else []) + list(stage.blocks)]


def _out_channels(module: nn.Module) -> int:
    convs = [op for op in conv_norm_act_ops(module) if isinstance(op, nn.Conv2d)]
    return int(convs[-1].out_channels)


def _osa_branch(blk: Any) -> Path:
    """The concatenation ``[x, c_1, c_2, ...]`` as ``Parallel`` branches (the chain's prefixes), then ``conv_concat``."""
    mid = [_out_channels(conv) for conv in blk.conv_mid]
    inputs = int(blk.conv_concat.conv.in_channels) - sum(mid)
    chain = conv_norm_act_ops(blk.conv_reduction)
    parts: list[Path] = [()]
    for conv in blk.conv_mid:
        chain = chain + conv_norm_act_ops(conv)
        parts.append(path_of(chain))
    return (Parallel.concat(parts, [inputs, *mid]), *path_of(conv_norm_act_ops(blk.conv_concat)))


def vovnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm VoVNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not VovNet:
        return f"{type(model).__name__} is not a timm VovNet"
    m: Any = model
    why = classifier_head_refusal(m.head) or path_refusal(conv_norm_act_ops(m.stem), "the stem")
    if why is not None:
        return why
    for s, stage in enumerate(m.stages):
        if type(stage) is not OsaStage:
            return f"stage {s} is {type(stage).__name__}; only timm's OsaStage is supported"
        if stage.pool is not None and type(stage.pool) is not nn.MaxPool2d:
            return f"stage {s}'s pool is {type(stage.pool).__name__}, not a max pool"
        for i, blk in enumerate(stage.blocks):
            where = f"stage {s} block {i}"
            if type(blk) is not OsaBlock:
                return f"{where} is {type(blk).__name__}; only timm's OsaBlock is supported"
            if blk.drop_path is not None and not isinstance(blk.drop_path, DropPath):
                return f"{where}'s drop_path is {type(blk.drop_path).__name__}, not timm's DropPath"
            modules = conv_norm_act_ops(blk.conv_reduction) + conv_norm_act_ops(blk.conv_mid) + conv_norm_act_ops(blk.conv_concat)
            why = path_refusal(modules + ([blk.attn] if blk.attn is not None else []), where)
            if why is not None:
                return why
            if path_of(conv_norm_act_ops(blk.conv_reduction) + conv_norm_act_ops(blk.conv_concat)):
                return f"{where}'s reduction or concat conv is not a 1x1 stride-1 convolution"
    return None


class HeadedConvNet(AdaptedConvNet):
    """An ``AdaptedConvNet`` of a timm model with a ``stem`` of ``ConvNormAct``\\ s (and pools) and timm's
    ``ClassifierHead`` (``forward_head``; per-position logits: ``classifier_head_positions``): VoVNet, CspNet, ReXNet."""

    def _stem_modules(self) -> list[nn.Module]:
        m: Any = self.model
        return conv_norm_act_ops(m.stem)

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return classifier_head_positions(m.head, x)


class AdaptedVovNet(HeadedConvNet):
    """A timm VoVNet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = VOVNET_FAMILY
    refusal = staticmethod(vovnet_refusal)

    def _blocks(self) -> list[nn.Module]:
        return _units(self.model)

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) is OsaBlock

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's ``OsaBlock.forward`` with the drop-path draw exposed (a stage's pool: the pool)."""
        if type(blk) is not OsaBlock:
            return blk(x), None
        output = [x]
        h = x if blk.conv_reduction is None else blk.conv_reduction(x)
        h = blk.conv_concat(blk.conv_mid(h, output))
        if blk.attn is not None:
            h = blk.attn(h)
        keep = None
        if blk.drop_path is not None:
            h, keep = branch(blk.drop_path, h)
        if blk.residual:
            return h + output[0], keep
        return h, None

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is not OsaBlock:
            return path_of([blk]), None
        return _osa_branch(blk), (() if blk.residual else None)


TINY_CFG = dict(
    stem_chs=[8, 8, 16], stage_conv_chs=[8, 8, 8, 8], stage_out_chs=[16, 16, 24, 24], layer_per_block=2,
    block_per_stage=[1, 1, 2, 1], residual=True, depthwise=False, attn="ese",
)
"""Four stages (the third with a residual block) on a 32x32 image: grids 8 (stem), 8, 4, 2, 1."""

FAMILY = Family(
    name="vovnet",
    description=VOVNET_FAMILY,
    refusal=AdaptedVovNet.refusal,
    build=AdaptedVovNet,
    example=tiny(VovNet, cfg=TINY_CFG),
    timm_modules=("vovnet",),
    speed_model="ese_vovnet19b_dw",
)
