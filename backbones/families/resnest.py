"""Adapter for timm's ResNeSt (a ``ResNet`` of ``ResNestBottleneck`` blocks with split attention); the stem,
shortcuts and head are ResNet's (helpers from ``families.resnet``).

A ``ResNestBottleneck``'s branch: a 1x1 conv, the average pool of ``avd_first``, ``SplitAttn``, the average pool of
``avd_last``, a 1x1 conv. ``SplitAttn`` is one grouped kxk conv making ``radix`` maps; their sum, pooled over every
position, gives a per-sample softmax over the radix for every channel, and the output is each position's maps
weighed by it and summed. The weighting is a channel gate computed from the globally pooled features (as
squeeze-excite) and the sum over the radix a fixed combination of one position's channels (as a 1x1 conv): no
position reads another's value but through the one conv, so the block's label path is that conv's rule (the
(out, in)-averaged normalised |kernel| over all its channel pairs, border-renormalised) between the pools'
windows. The block's events are ResNet's: the shortcut keeps (or aggregates) the labels and the branch's labels
join by the residual rule; stem from the pixels; ``pool("mean", 0)``.

timm's ``ResNestBottleneck.forward`` applies its drop-path to the block's input before the shortcut's projection,
not to the branch (and not at all where the shortcut is the identity), so a model built with ``drop_path_rate > 0``
is refused: the residual rule's "who kept the branch" has no meaning there.

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions, ``l`` label channels.
"""

from __future__ import annotations

from typing import Any

from timm.layers.split_attn import SplitAttn
from timm.models.resnest import ResNestBottleneck
from timm.models.resnet import ResNet
from torch import Tensor, nn

from mixlabels.backbones._convnet import AdaptedConvNet, Path, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families.resnet import _blocks, _flat, _stem_modules, _token_logits

__all__ = ["AdaptedResNeSt", "RESNEST_FAMILY", "resnest_refusal"]

RESNEST_FAMILY = (
    "timm ResNeSt (ResNet of ResNestBottleneck blocks, deep stem, avg-pool shortcuts): every position a token; "
    "split attention's grouped kxk conv mixes labels by the (out, in)-averaged normalised |kernel| "
    "(border-renormalised), its per-channel softmax over the radix and the radix sum as channel ops; avd average "
    "pools, strided convs and pools aggregate over their windows; 1x1 convs, norms, activations as channel ops; "
    "residual rule with the shortcut's labels; stem from the pixels; global average pooling; no stochastic depth "
    "(timm drops the shortcut's input, not the branch)"
)


def _conv2_modules(blk: Any) -> list[nn.Module]:
    """``conv2`` as the ops its forward runs: ``SplitAttn``'s conv, norm, DropBlock and activation (the radix
    weighting after them is a channel op), or a plain conv (``radix=0``)."""
    if type(blk.conv2) is SplitAttn:
        sa: Any = blk.conv2
        return [sa.conv, sa.bn0, sa.drop, sa.act0]
    return [blk.conv2]


def _branch_modules(blk: Any) -> list[nn.Module]:
    """The branch's modules in the order of timm's ``forward``."""
    return [blk.conv1, blk.bn1, blk.act1, *_flat(blk.avd_first), *_conv2_modules(blk), blk.bn2, blk.drop_block, blk.act2,
            *_flat(blk.avd_last), blk.conv3, blk.bn3, blk.act3]


def resnest_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm ResNeSt this adapter carries labels through (``None``: it is)."""
    if type(model) is not ResNet:
        return f"{type(model).__name__} is not a timm ResNet"
    m: Any = model
    if m.global_pool.pool_type != "avg":
        return f"global_pool={m.global_pool.pool_type!r} has no label readout; use 'avg'"
    why = path_refusal(_stem_modules(m), "the stem")
    if why is not None:
        return why
    for i, blk in enumerate(_blocks(m)):
        where = f"block {i}"
        if type(blk) is not ResNestBottleneck:
            return f"{where} is {type(blk).__name__}; only timm's ResNestBottleneck is supported here"
        if blk.drop_path is not None:
            return (f"{where} has drop_path: timm's ResNestBottleneck drops the shortcut's input, not the branch, which "
                    "the residual rule cannot follow; build the model with drop_path_rate=0")
        if type(blk.conv2) not in (SplitAttn, nn.Conv2d):
            return f"{where}'s conv2 is {type(blk.conv2).__name__}, not timm's SplitAttn or a conv"
        why = path_refusal(_branch_modules(blk), f"{where}'s branch") or path_refusal(_flat(blk.downsample), f"{where}'s shortcut")
        if why is not None:
            return why
    return None


class AdaptedResNeSt(AdaptedConvNet):
    """A timm ResNeSt returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = RESNEST_FAMILY
    refusal = staticmethod(resnest_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        return _stem_modules(self.model)

    def _blocks(self) -> list[nn.Module]:
        return _blocks(self.model)

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's block forward; every branch kept (drop-path is refused)."""
        return blk(x), None

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        return path_of(_branch_modules(blk)), path_of(_flat(blk.downsample))

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        return _token_logits(self.model, x)


FAMILY = Family(
    name="resnest",
    description=RESNEST_FAMILY,
    refusal=AdaptedResNeSt.refusal,
    build=AdaptedResNeSt,
    # radix-2 split attention, avd pools after it, on a 32x32 image: grids 8 (stem), 8, 4, 2, 1
    example=tiny(ResNet, block=ResNestBottleneck, layers=(1, 1, 1, 1), channels=(8, 8, 8, 8), stem_type="deep",
                 stem_width=8, avg_down=True, base_width=64, cardinality=1, block_args={"radix": 2, "avd": True}),
    timm_modules=("resnest",),
    speed_model="resnest14d",
)
