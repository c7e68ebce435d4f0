"""Adapter for torchvision's MaxVit (maxvit_t): MBConv, then window and grid attention, in every MaxVitLayer.

The rules of timm's MaxViT (``backbones.families.maxxvit``, whose stem, partition label layout and
reference sizes it shares) on torchvision's modules. A *unit* (one label ``layer``) is each of a
``MaxVitLayer``'s three residual parts, counted over the blocks:

- stem (3x3 stride-2 conv, then 3x3 stride-1 conv, both full convs): labels start on the pixels and
  ``aggregate`` sums them over each conv's windows, as timm's MaxViT stem; a MixToken map starts on
  the stem's grid.
- ``MBConv`` (pre-norm, 1x1 expansion, depthwise 3x3 possibly strided, squeeze-excitation, 1x1): the
  events of ``backbones._convnet.block_labels``: a stride-1 depthwise conv mixes the branch's labels
  by its normalised |kernel|, a strided one and the shortcut's 3x3/2 average pool aggregate over
  their windows; 1x1 convs, batch norms, activations and the squeeze-excitation are channel ops;
  then ``residual(layer, keep, mixed=...)`` with torchvision's stochastic-depth draw.
- window / grid attention (``PartitionAttentionLayer``): ``mean_h(A_h) Y`` inside each partition,
  ``A_h = softmax(q (s k)^T + B_h)`` exactly as torchvision computes it (``s`` its ``feat_dim**-0.5``,
  the whole width's, not the head's; ``B`` its relative position bias), the labels partitioned
  exactly as the tokens. torchvision's ``WindowPartition(p)`` cuts ``(nh p) (nw p)``; for the grid
  partition ``p`` is the number of partitions and ``SwapAxes`` makes the window the dilated grid
  ``(gh nh) (gw nw)`` (timm's ``grid_partition``). The MLP residual moves no labels; both residuals
  draw their own stochastic depth from the layer's one ``StochasticDepth``.
- readout: ``pool("mean", 0)``: the head pools first, then LayerNorm, Linear, Tanh, Linear on the
  pooled vector (channel ops; no class token: TransMix refuses).

torchvision builds every partition layer for one grid (``MaxVit(input_size=...)``): its relative
position bias and its departition are fixed then, and another grid fails there or, with as many
tokens, is silently laid out wrong. The adapter refuses such images per input, naming the size
the model was built for.

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` tokens, ``l`` label channels, ``g`` partitions
(``nh nw``), ``p`` a partition's tokens, ``h`` (in attention) heads, ``d`` head dim.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, reduce
from torch import Tensor, nn
from torchvision.models.maxvit import (
    MaxVit,
    MaxVitBlock,
    MaxVitLayer,
    MBConv,
    PartitionAttentionLayer,
    RelativePositionalMultiHeadAttention,
)
from torchvision.ops.misc import Conv2dNormActivation, SqueezeExcitation
from torchvision.ops.stochastic_depth import StochasticDepth

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap
from mixlabels.backbones._attention import explicit_mix
from mixlabels.backbones._common import AdaptedBase, branch, check_static_conv, start_on_convs
from mixlabels.backbones._convnet import Path, block_labels, block_labels_reference, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._dense import DenseRules
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks
from mixlabels.backbones.families.maxxvit import (
    departition_labels,
    embed_stem,
    partition_axes,
    partition_labels,
    partition_matrix,
    partition_sizes,
    stem_reference_bytes,
)

__all__ = ["AdaptedTvMaxVit", "TV_MAXVIT_FAMILY", "tv_maxvit_refusal"]

TV_MAXVIT_FAMILY = (
    "torchvision MaxVit (maxvit_t; square input_size, images of the size it was built for): MBConv blocks "
    "(depthwise conv as normalised-absolute-kernel spatial mix, strided conv and pooled shortcut as aggregation, "
    "SE, 1x1 convs, norms as channel ops), then window and grid attention with relative position bias (head-mean "
    "attention inside each partition); conv stem as aggregation; global average pooling before the head's "
    "LayerNorm, Linear, Tanh, Linear; stochastic depth"
)

BUILDERS = ("maxvit_t",)

_HEAD = [nn.AdaptiveAvgPool2d, nn.Flatten, nn.LayerNorm, nn.Linear, nn.Tanh, nn.Linear]


def _units(m: Any) -> list[nn.Module]:
    """Every residual unit in order (``MBConv``, window attention, grid attention per layer): one label ``layer``
    each, and one FSDP unit each. The walk tells them apart by ``isinstance``: ``fully_shard`` subclasses them."""
    return [part for blk in m.blocks for lay in blk.layers for part in lay.layers]


def _stem_convs(m: Any) -> tuple[nn.Conv2d, nn.Conv2d]:
    return m.stem[0][0], m.stem[1][0]


def _stem_stride(m: Any) -> tuple[int, int]:
    sh, sw = _stem_convs(m)[0].stride
    return sh, sw


def _paths(mb: Any) -> tuple[Path, Path]:
    """An MBConv's branch (its strided or stride-1 depthwise conv) and shortcut (the 3x3/2 pool where it
    downsamples; nothing spatial otherwise: an identity or a 1x1 conv)."""
    shortcut = path_of(list(mb.proj)) if isinstance(mb.proj, nn.Sequential) else ()
    return path_of(conv_norm_act_ops(mb.layers)), shortcut


def _mbconv_refusal(mb: Any, where: str) -> str | None:
    if not isinstance(mb.proj, (nn.Identity, nn.Sequential)):
        return f"{where}'s shortcut is {type(mb.proj).__name__}, not torchvision's (identity, or pool and 1x1 conv)"
    if not isinstance(mb.stochastic_depth, (nn.Identity, StochasticDepth)):
        return f"{where}'s stochastic depth is {type(mb.stochastic_depth).__name__}, not torchvision's StochasticDepth"
    shortcut = list(mb.proj) if isinstance(mb.proj, nn.Sequential) else []
    return path_refusal(shortcut, f"{where}'s shortcut") or path_refusal(conv_norm_act_ops(mb.layers), f"{where}'s branch", (SqueezeExcitation,))


def _partition_refusal(u: Any, where: str) -> str | None:
    """Why a ``PartitionAttentionLayer`` has no label rule here; also one whose windows its own relative position
    bias does not fit (a non-square ``input_size``: torchvision counts the grid's partitions by its height alone)."""
    if [type(mod) for mod in u.attn_layer] != [nn.LayerNorm, RelativePositionalMultiHeadAttention, nn.Dropout]:
        return f"{where}'s attn_layer is not torchvision's (LayerNorm, RelativePositionalMultiHeadAttention, Dropout)"
    why = path_refusal([mod for mod in u.mlp_layer if type(mod) is not nn.Linear], f"{where}'s MLP")  # Linear: per token
    if why is not None:
        return why
    if type(u.stochastic_dropout) is not StochasticDepth:
        return f"{where}'s stochastic depth is {type(u.stochastic_dropout).__name__}, not torchvision's StochasticDepth"
    side = u.attn_layer[1].size  # the window side the relative position bias was built for
    (gh, gw), p = u.grid_size, u.p
    window = (p, p) if u.partition_type == "window" else (gh // p, gw // p)
    if gh % p or gw % p or window != (side, side):
        return (
            f"{where}'s {u.partition_type} partition of its {gh}x{gw} grid makes {window[0]}x{window[1]} windows where "
            f"its relative position bias is {side}x{side} (torchvision counts grid partitions by the height alone); "
            "build MaxVit with a square input_size"
        )
    return None


def tv_maxvit_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a torchvision MaxVit this adapter carries labels through (``None``: it is)."""
    if type(model) is not MaxVit:
        return f"{type(model).__name__} is not a torchvision MaxVit"
    m: Any = model
    head = list(m.classifier)
    if [type(mod) for mod in head] != _HEAD or head[0].output_size not in (1, (1, 1)):
        return "the classifier is not torchvision's (AdaptiveAvgPool2d(1), Flatten, LayerNorm, Linear, Tanh, Linear)"
    if len(m.stem) != 2 or any(type(s) is not Conv2dNormActivation for s in m.stem):
        return "the stem is not torchvision's (two Conv2dNormActivation)"
    first, second = _stem_convs(m)
    why = check_static_conv(first, "the stem's first conv") or check_static_conv(second, "the stem's second conv")
    why = why or path_refusal(conv_norm_act_ops(m.stem), "the stem")
    for i, blk in enumerate(m.blocks):
        if why is not None:
            return why
        if type(blk) is not MaxVitBlock or any(type(lay) is not MaxVitLayer for lay in blk.layers):
            return f"block {i} is not torchvision's MaxVitBlock of MaxVitLayers"
        for j, lay in enumerate(blk.layers):
            where = f"block {i} layer {j}"
            parts = list(lay.layers)
            kinds = [type(part) for part in parts]
            if kinds != [MBConv, PartitionAttentionLayer, PartitionAttentionLayer] or [u.partition_type for u in parts[1:]] != ["window", "grid"]:
                return f"{where} is not torchvision's (MBConv, window attention, grid attention)"
            why = why or _mbconv_refusal(parts[0], f"{where}'s MBConv")
            why = why or _partition_refusal(parts[1], f"{where}'s window attention") or _partition_refusal(parts[2], f"{where}'s grid attention")
    return why


def _mbconv(mb: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """torchvision's ``MBConv.forward`` with the stochastic-depth draw exposed."""
    shortcut = mb.proj(x)
    h, keep = branch(mb.stochastic_depth, mb.layers(x))
    return shortcut + h, keep


def _attend(attn: Any, x: Tensor, labels: Tensor | None, reference: bool) -> tuple[Tensor, Tensor | None]:
    """torchvision's ``RelativePositionalMultiHeadAttention.forward`` on partitions ``x`` ``(b, g, p, c)``, and
    ``mean_h(A_h) @ labels`` ``((b g), p, l)`` by the same ``A``; with ``reference`` the explicit head-mean
    matrices ``((b g), p, p)`` float64 instead.

    The scores are torchvision's own einsum (the key scaled, by the whole width's ``scale_factor``): the labels
    move by exactly the weights the model uses, and the logits stay bit-equal to the bare model's.
    """
    q, k, v = rearrange(attn.to_qkv(x), "b g p (three h d) -> three b g h p d", three=3, h=attn.n_heads)
    scores = torch.einsum("B G H I D, B G H J D -> B G H I J", q, k * attn.scale_factor)
    a = F.softmax(scores + attn.get_relative_positional_bias(), dim=-1)  # b g h p p
    out = torch.einsum("B G H I J, B G H J D -> B G H I D", a, v)
    out = attn.merge(rearrange(out, "b g h p d -> b g p (h d)"))
    heads = rearrange(a, "b g h i j -> (b g) h i j")
    if reference:
        return out, reduce(heads.detach().double(), "n h i j -> n i j", "mean")
    return out, (None if labels is None else explicit_mix(heads, labels))


def _partition_layer(
    u: Any, x: Tensor, sizes: dict[str, int], labels: Tensor | None, reference: bool
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """torchvision's ``PartitionAttentionLayer.forward`` on NCHW ``x``, its partitions as einops patterns (the
    labels' own, ``maxxvit.partition_labels``). Returns the output (NCHW), the partitions' label mix (see
    ``_attend``), and who kept the attention and the MLP branch."""
    side, inner = partition_axes(u.partition_type == "window")
    t = rearrange(x, f"b c {side} -> b (nh nw) {inner} c", **sizes)
    norm, attn, attn_drop = u.attn_layer
    out, mixed = _attend(attn, norm(t), labels, reference)
    out, keep_attn = branch(u.stochastic_dropout, attn_drop(out))
    t = t + out
    out, keep_mlp = branch(u.stochastic_dropout, u.mlp_layer(t))
    t = t + out
    return rearrange(t, f"b (nh nw) {inner} c -> b c {side}", **sizes), mixed, keep_attn, keep_mlp


def _partition_sizes(m: Any, u: Any, grid: tuple[int, int]) -> dict[str, int]:
    """The einops sizes of a partition layer on ``grid``: refused where it is not the grid the layer was built for."""
    if grid != tuple(u.grid_size):
        gh, gw = m.blocks[0].grid_size  # the stem and the first MBConv each halve the image (3x3, stride 2, padding 1)
        raise ValueError(
            f"a {grid[0]}x{grid[1]} token grid reached a {u.partition_type} attention built for {u.grid_size[0]}x"
            f"{u.grid_size[1]}: torchvision's MaxVit fixes its partitions at construction (input_size); use "
            f"{4 * gh}x{4 * gw} images, or build the model with input_size=(H, W) of your images"
        )
    side = u.attn_layer[1].size
    return partition_sizes(grid, (side, side), u.partition_type == "window", "build MaxVit with another input_size")


def _head(m: Any, x: Tensor, needs_token_logits: bool) -> tuple[Tensor, Tensor | None]:
    """The classifier on the pooled map, and (token-labelling schemes) after the pool on every position ``(b, n, classes)``."""
    logits = m.classifier(x)
    return logits, (m.classifier[2:](rearrange(x, "b c h w -> b (h w) c")) if needs_token_logits else None)


class AdaptedTvMaxVit(AdaptedBase):
    """A torchvision MaxVit returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = TV_MAXVIT_FAMILY
    refusal = staticmethod(tv_maxvit_refusal)

    def reference_bytes(self, label_map: TokenLabelMap) -> int:
        """The stem matrices, this family's largest (checked by ``AdaptedBase.forward`` before they are built)."""
        return stem_reference_bytes(_stem_stride(self.model), label_map)

    # No fsdp_units: as the other torchvision families, the adapted root is sharded (per-block sharding of this
    # family failed the 2-rank gradient check once merged, and is refused until it passes; docs/distributed.md).

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = embed_stem(m.stem, _stem_stride(m), images, label_map)
        units = _units(m)
        tracker = start_on_convs(self.scheme, label_map, start, grid, len(units), _stem_convs(m))
        for layer, u in enumerate(units):
            x, grid = through_hooks(u, functools.partial(self._unit, u, grid=grid, layer=layer, tracker=tracker), x)
        tracker.pool("mean", 0)
        output, token_logits = _head(m, x, self.scheme.needs_token_logits)
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def _unit(self, u: Any, x: Tensor, grid: tuple[int, int], layer: int, tracker: LabelTracker) -> tuple[Tensor, tuple[int, int]]:
        if isinstance(u, MBConv):
            x, keep = _mbconv(u, x)
            return x, block_labels(tracker, layer, grid, *_paths(u), keep)
        block = u.partition_type == "window"
        sizes = _partition_sizes(self.model, u, grid)
        pre = tracker.labels_for(layer)
        labels = None if pre is None else partition_labels(pre, grid, sizes, block)
        x, mixed, keep_attn, keep_mlp = _partition_layer(u, x, sizes, labels, reference=False)
        tracker.residual(layer, keep_attn, mixed=None if mixed is None else departition_labels(mixed, sizes, block))
        tracker.residual(layer, keep_mlp, mixed=None)  # the MLP: channel mixing
        return x, grid

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit matrices (windows, kernels, attention scattered over the grid) on dense labels."""
        m: Any = self.model
        x, grid, start = embed_stem(m.stem, _stem_stride(m), images, label_map)
        units = _units(m)
        rules = DenseRules(self.scheme, label_map, start, 0, len(units))
        rules.aggregate_convs(start, grid, _stem_convs(m))
        for layer, u in enumerate(units):
            if isinstance(u, MBConv):
                x, keep = _mbconv(u, x)
                grid = block_labels_reference(rules, layer, grid, *_paths(u), keep)
                continue
            sizes = _partition_sizes(m, u, grid)
            x, mixed, keep_attn, _ = _partition_layer(u, x, sizes, None, reference=True)
            assert mixed is not None
            rules.mix(layer, partition_matrix(mixed, grid, sizes, u.partition_type == "window"), keep_attn)
        output, token_logits = _head(m, x, self.scheme.needs_token_logits)
        return rules.result(output, output, "mean", token_logits)


FAMILY = Family(
    name="tv_maxvit",
    description=TV_MAXVIT_FAMILY,
    refusal=AdaptedTvMaxVit.refusal,
    build=AdaptedTvMaxVit,
    # 32 px: stem 16x16, then 8x8, 4x4, 2x2 grids; 2x2 windows and grids; a stride-1 MBConv in block 1
    example=tiny(MaxVit, input_size=(32, 32), stem_channels=8, partition_size=2, block_channels=[8, 16, 32],
                 block_layers=[1, 2, 1], head_dim=8, stochastic_depth_prob=0.2),
    timm_modules=(),
    torchvision_builders=BUILDERS,
)
