"""Adapter for timm's MaxxVit: MaxViT (MBConv, block and grid attention), CoAtNet (MBConv, then rel-pos attention).

TL-Align Table 10 and Appendix D extended by the reasoning used for ConvNeXt, Swin and
MetaFormer: token mixers move labels by their normalised absolute weights, strided
windows aggregate, channel ops leave labels alone. A *unit* is one residual token mixer
and one ``layer``: an MBConv (or ConvNeXt) conv block, a ``TransformerBlock2d`` (CoAtNet),
and each of a MaxViT block's block-attention and grid-attention sub-blocks (a MaxViT block
is three units: conv, block attention, grid attention).

- stem (3x3 stride 2, then 3x3 stride 1, both full convs): labels start on the pixels and
  ``aggregate`` sums them over each conv's windows (zero padding adds nothing), as
  MetaFormer's and PVT v2's stems, so a first-stage token's labels are the source fractions of
  the stem's receptive field (a stride-1 full conv *between* token stages, Nest's ConvPool, is a
  token mixer instead and takes the normalised-``|K|`` rule); a MixToken map starts on the stem's grid.
- conv unit (``MbConvBlock``: pre-norm, 1x1, depthwise kxk, SE, 1x1; ``ConvNeXtBlock``): the
  stride-1 depthwise conv is the spatial mix ``Norm(T(K)) Y`` (``conv_mix``, as ConvNeXt's);
  the 1x1 convs, norms, SE (a per-sample channel gate), MLP and layer scale are channel ops.
- downsampling unit (the first of every stage): the shortcut's pool (``Downsample2d``: 2x2/2
  or 3x3/2 average or max pool, then a 1x1 conv) is an ``aggregate`` event: every output
  token's labels are the sum over its pooling window, renormalised (a max pool picks one
  tap per channel and token, different taps in different channels, so its window as a whole
  is what the token draws on). The branch starts from the labels *before* that aggregate
  and follows its own strided window (the branch's pool in ``stride_mode='pool'``, the
  strided 1x1 in ``'1x1'``, the strided depthwise conv in ``'dw'``: strided convs aggregate,
  as every downsampling conv here does), then its stride-1 mixes; ``residual`` combines the
  two: ``(Norm(S Y) + Norm(B Y)) / 2``, exactly the residual rule with a non-identity shortcut.
- block attention (``partition_type='block'``): ``mean_h(A_h) Y`` inside each window,
  ``A_h`` including the relative position bias (``RelPosBias``, ``RelPosMlp``, ``RelPosBiasTf``:
  one additive ``attn_mask``); grid attention likewise over the dilated grid partition; the
  labels are partitioned exactly as the tokens and put back.
- CoAtNet transformer unit: the same over the whole grid (after its pool, when it downsamples).
- readout: ``pool("mean", 0)`` (global average pooling; no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` tokens, ``l`` label channels,
``nh nw`` partitions, ``wh ww`` a window, ``gh gw`` a grid partition.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.classifier import ClassifierHead, NormMlpClassifierHead
from timm.layers.conv2d_same import Conv2dSame
from timm.layers.eca import EcaModule
from timm.layers.pool2d_same import AvgPool2dSame, MaxPool2dSame
from timm.layers.squeeze_excite import SEModule
from timm.models.maxxvit import (
    Attention2d,
    AttentionCl,
    ConvNeXtBlock,
    Downsample2d,
    MaxxVit,
    MaxxVitBlock,
    MbConvBlock,
    PartitionAttention2d,
    PartitionAttentionCl,
    TransformerBlock2d,
    grid_partition,
    grid_partition_nchw,
    grid_reverse,
    grid_reverse_nchw,
    window_partition,
    window_partition_nchw,
    window_reverse,
    window_reverse_nchw,
)
from torch import Tensor, nn

from mixlabels import AlignedOutput, DenseTracker, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._attention import attention_with_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, check_static_conv, conv_label_kernel, conv_mix, explicit_mix, mix_token_space
from mixlabels.backbones._convnet import Window, merge_matrix, path_grid, start_on_path
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise, window_matrix
from mixlabels.backbones._windows import average_windows
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks
from timm.models.maxxvit import MaxxVitCfg
from timm.models.maxxvit import MaxxVitTransformerCfg

__all__ = [
    "AdaptedMaxxVit",
    "MAXXVIT_FAMILY",
    "departition_labels",
    "embed_stem",
    "partition_axes",
    "partition_labels",
    "partition_matrix",
    "partition_sizes",
    "stem_reference_bytes",
]

MAXXVIT_FAMILY = (
    "timm MaxxVit: MaxViT (MBConv, then block and grid attention), CoAtNet (MBConv stages, then transformer "
    "stages over the whole grid), MaxxViT/CoAtNeXt (ConvNeXt conv blocks); relative position bias (bias, mlp, "
    "bias_tf) as an additive mask of the head-mean attention; depthwise convs as normalised-absolute-kernel "
    "spatial mixes; conv stem, strided convs and pooled shortcuts as aggregation; SE, 1x1 convs, norms as "
    "channel ops; static or TF 'same' padding (maxvit_*_tf_*: strided convs' and pools' windows resolved on each "
    "input grid); global average pooling; stochastic depth"
)

_Op = tuple[str, Any]  # ("sum", a Window) or ("conv", a stride-1 depthwise nn.Conv2d)
_SAME = (Conv2dSame, AvgPool2dSame, MaxPool2dSame)  # TF 'same' padding (maxvit_*_tf_*): windows resolved per grid
_ONE = Window((1, 1), (1, 1), (0, 0))  # a 1x1 stride-1 conv's window: a channel op
_CHANNEL_GATES = (SEModule, EcaModule)  # per-sample channel attention: channel ops

BLOCK = "(nh wh) (nw ww)"  # window partition: contiguous windows
GRID = "(gh nh) (gw nw)"  # grid partition: every (nh, nw)-th token, a dilated window
FIX = "pick an image size (or transformer_window_size / transformer_grid_size) whose every stage tiles"


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _window(mod: Any) -> Window:
    """A conv's or pool's windows: static padding, or TF 'same' (resolved on the grid each is applied to)."""
    if type(mod) in _SAME:
        return Window(_pair(mod.kernel_size), _pair(mod.stride), (0, 0), same=True)
    return Window(_pair(mod.kernel_size), _pair(mod.stride), _pair(mod.padding))


def _same_conv_refusal(conv: Any, what: str) -> str | None:
    """Why a ``Conv2dSame`` has no window here: only strided undilated ones aggregate (a stride-1 one pads one side
    more, which no label rule follows); ``None`` for any other module (its own checks apply)."""
    if type(conv) is not Conv2dSame:
        return None
    if _pair(conv.stride) == (1, 1) or _pair(conv.dilation) != (1, 1):
        return (f"{what} is a Conv2dSame of stride {tuple(conv.stride)}, dilation {tuple(conv.dilation)}: only strided, "
                "undilated TF 'same' convolutions aggregate here; use conv_padding=''")
    return None


def _full_conv_refusal(conv: Any, what: str) -> str | None:
    """``check_static_conv``, or a strided TF 'same' conv (its windows resolved per grid)."""
    return _same_conv_refusal(conv, what) if type(conv) is Conv2dSame else check_static_conv(conv, what)


def _pool_refusal(down: Any, what: str) -> str | None:
    if type(down) is not Downsample2d:
        return f"{what} is {type(down).__name__}, not timm's Downsample2d"
    p = down.pool
    pools = (nn.AvgPool2d, nn.MaxPool2d, AvgPool2dSame, MaxPool2dSame)
    if type(p) not in pools or p.ceil_mode or (isinstance(p, nn.MaxPool2d) and _pair(p.dilation) != (1, 1)):
        return (f"{what}'s pool is {type(p).__name__}; only an AvgPool2d/MaxPool2d, static or 'same' (no ceil_mode or "
                "dilation), has a window")
    return None


def _dw_refusal(conv: Any, what: str) -> str | None:
    if type(conv) is Conv2dSame:
        why = _same_conv_refusal(conv, what)
        if why is not None:
            return why
    elif type(conv) is not nn.Conv2d:
        return f"{what} is {type(conv).__name__}, not a plain nn.Conv2d"
    if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        return f"{what} uses padding {conv.padding!r} ({conv.padding_mode}); only static zero padding is supported"
    if conv.groups != conv.in_channels:  # depthwise, possibly with a channel multiplier (ConvNeXtBlock's widening)
        return f"{what} is a grouped (conv group_size > 1), not a depthwise convolution; use conv_group_size=1"
    return None


def _conv_refusal(blk: Any, where: str) -> str | None:
    if type(blk) is MbConvBlock:
        if blk.se_early is not None and not isinstance(blk.se_early, _CHANNEL_GATES):
            return f"{where}'s attention {type(blk.se_early).__name__} is not a channel gate (se, eca)"
        if blk.se is not None and not isinstance(blk.se, (*_CHANNEL_GATES, nn.Identity)):
            return f"{where}'s attention {type(blk.se).__name__} is not a channel gate (se, eca)"
        why = _full_conv_refusal(blk.conv1_1x1, f"{where}'s conv1_1x1") or check_static_conv(blk.conv3_1x1, f"{where}'s conv3_1x1")
        if why is None and (_pair(blk.conv1_1x1.kernel_size) != (1, 1) or _window(blk.conv3_1x1) != _ONE):
            why = f"{where}'s 1x1 convs are not 1x1"
        dw = blk.conv2_kxk
    elif type(blk) is ConvNeXtBlock:
        why = None
        if not isinstance(blk.shortcut, (nn.Identity, Downsample2d)):
            why = check_static_conv(blk.shortcut, f"{where}'s shortcut")
            if why is None and _window(blk.shortcut) != _ONE:
                why = f"{where}'s shortcut conv is not a 1x1 stride-1 conv"
        dw = blk.conv_dw
    else:
        return f"{where} is {type(blk).__name__}; only MbConvBlock, ConvNeXtBlock, TransformerBlock2d and MaxxVitBlock are supported"
    return why or _down_refusal(blk, where) or _dw_refusal(dw, f"{where}'s depthwise conv")


def _down_refusal(blk: Any, where: str) -> str | None:
    for what, down in ((f"{where}'s shortcut", blk.shortcut), (f"{where}'s down", getattr(blk, "down", nn.Identity()))):
        if isinstance(down, Downsample2d) or (what.endswith("down") and not isinstance(down, nn.Identity)):
            why = _pool_refusal(down, what)
            if why is not None:
                return why
    return None


def _attention_refusal(attn: Any, where: str) -> str | None:
    if type(attn) not in (Attention2d, AttentionCl):
        return f"{where} is {type(attn).__name__}, not timm's Attention2d or AttentionCl"
    if attn.rel_pos is not None and not callable(getattr(attn.rel_pos, "get_bias", None)):
        return f"{where}'s relative position {type(attn.rel_pos).__name__} has no additive get_bias()"
    return None


def _maxxvit_refusal(model: nn.Module) -> str | None:
    if type(model) is not MaxxVit:
        return f"{type(model).__name__} is not a timm MaxxVit"
    m: Any = model
    if not isinstance(m.head, (ClassifierHead, NormMlpClassifierHead)) or m.head.global_pool.pool_type != "avg":
        return f"global_pool={m.global_pool!r} has no label readout; use 'avg'"
    if not isinstance(m.norm, (nn.Identity, nn.BatchNorm2d)) and type(m.norm).__name__ != "LayerNorm2d":
        return f"the final norm is {type(m.norm).__name__}; only a per-position norm is supported"
    for name in ("conv1", "conv2"):
        why = _full_conv_refusal(getattr(m.stem, name), f"the stem's {name}")
        if why is not None:
            return why
    for i, stage in enumerate(m.stages):
        for j, blk in enumerate(stage.blocks):
            where = f"stage {i} block {j}"
            if type(blk) is MaxxVitBlock:
                why = _conv_refusal(blk.conv, f"{where}'s conv")
                for part in (blk.attn_block, blk.attn_grid):
                    if why is None and part is not None:
                        why = _attention_refusal(part.attn, f"{where}'s partition attention")
            elif type(blk) is TransformerBlock2d:
                why = _down_refusal(blk, where) or _attention_refusal(blk.attn, f"{where}'s attention")
                if why is None and isinstance(blk.norm1, nn.Sequential):
                    why = _pool_refusal(blk.norm1.down, f"{where}'s norm1.down")
            elif type(blk).__name__ == "ParallelMaxxVitBlock":
                why = (
                    f"{where} is a ParallelMaxxVitBlock (block type 'PM', maxvit_tiny_pm_256: block and grid "
                    "attention concatenated on half channels each) which this adapter does not cover; use the "
                    "sequential 'M' blocks (maxvit_tiny_rw_256)"
                )
            else:
                why = _conv_refusal(blk, where)
            if why is not None:
                return why
    return None


def _units(m: Any) -> list[Any]:
    """Every residual token mixer in order: one label ``layer`` each, and one FSDP unit each (``fsdp_units``).

    The walk tells them apart by ``isinstance``, not ``type``: ``fully_shard`` makes a sharded unit's class a subclass.
    """
    units: list[Any] = []
    for stage in m.stages:
        for blk in stage.blocks:
            if type(blk) is MaxxVitBlock:
                units += [blk.conv] + [p for p in (blk.attn_block, blk.attn_grid) if p is not None]
            else:
                units.append(blk)
    return units


def _shortcut_window(u: Any) -> Window | None:
    return _window(u.shortcut.pool) if isinstance(u.shortcut, Downsample2d) else None


def _branch_ops(u: Any) -> list[_Op]:
    """The spatial steps of a unit's residual branch before its token mixing: pools, strided convs
    (aggregated over their windows) and stride-1 depthwise convs (mixed by their kernels)."""
    ops: list[_Op] = []
    if isinstance(u, TransformerBlock2d):
        norm1: Any = u.norm1
        if isinstance(norm1, nn.Sequential):  # (norm, down): the branch pools first
            ops.append(("sum", _window(getattr(norm1, "down").pool)))
        return ops
    if isinstance(u.down, Downsample2d):
        ops.append(("sum", _window(u.down.pool)))
    if isinstance(u, MbConvBlock) and _pair(u.conv1_1x1.stride) != (1, 1):
        ops.append(("sum", _window(u.conv1_1x1)))
    dw = u.conv2_kxk if isinstance(u, MbConvBlock) else u.conv_dw
    ops.append(("sum", _window(dw)) if _pair(dw.stride) != (1, 1) else ("conv", dw))
    return ops


def _branch_labels(ops: list[_Op], labels: Tensor, grid: tuple[int, int]) -> tuple[Tensor, tuple[int, int]]:
    """Labels ``(b, n, l)`` through ``ops``: windows summed and renormalised, depthwise convs mixed."""
    for kind, op in ops:
        if kind == "sum":
            labels, grid = average_windows(labels, grid, (op.axes(grid),))
        else:
            labels = conv_mix(labels, grid, conv_label_kernel(op.weight), op.padding, op.dilation)
    return labels, grid


def _branch_matrix(ops: list[_Op], grid: tuple[int, int]) -> tuple[Tensor, tuple[int, int]]:
    """``ops`` as one explicit row-stochastic ``(n', n)`` float64 matrix (the reference)."""
    m: Tensor | None = None  # the identity, never built: a stem-sized (n, n) eye is gigabytes
    for kind, op in ops:
        if kind == "sum":
            w, grid = merge_matrix(grid, op)
        else:
            k = kernel_reference(op.weight)
            w, grid = conv_matrix(grid, k, padding=op.padding, dilation=op.dilation)
        m = row_normalise(w) if m is None else row_normalise(w) @ m
    return (torch.eye(grid[0] * grid[1], dtype=torch.float64) if m is None else m), grid


def stem_reference_bytes(stride: tuple[int, int], label_map: TokenLabelMap) -> int:
    """The stem matrices' bytes (pixels to the grid of a stem of ``stride``, and that grid's own): the reference's
    largest."""
    h, w = label_map.image_size
    tokens = (h // stride[0]) * (w // stride[1])
    pixels = tokens if label_map.token_space else h * w
    return 8 * tokens * max(pixels, tokens)


def _conv_branch(u: Any, x: Tensor) -> Tensor:
    """timm's conv block forward without its drop path and shortcut: the residual branch."""
    if isinstance(u, MbConvBlock):
        x = u.norm1(u.conv1_1x1(u.down(u.pre_norm(x))))
        x = u.conv2_kxk(x)
        if u.se_early is not None:
            x = u.se_early(x)
        x = u.norm2(x)
        if u.se is not None:
            x = u.se(x)
        return u.conv3_1x1(x)  # type: ignore[no-any-return]
    x = u.conv_dw(u.down(x))
    if u.use_conv_mlp:
        return u.ls(u.mlp(u.norm(x)))  # type: ignore[no-any-return]
    return rearrange(u.ls(u.mlp(u.norm(rearrange(x, "b c h w -> b h w c")))), "b h w c -> b c h w")  # type: ignore[no-any-return]


def _qkv(attn: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v ``(b, heads, n, d)`` from timm's channel layout: heads first (h three d) or interleaved (three h d)."""
    groups = "(h three d)" if attn.head_first else "(three h d)"
    if type(attn) is AttentionCl:  # (b, wh, ww, c) windows
        pattern = f"b wh ww {groups} -> three b h (wh ww) d"
    else:  # (b, c, h, w)
        pattern = f"b {groups} wh ww -> three b h (wh ww) d"
    q, k, v = rearrange(attn.qkv(x), pattern, three=3, h=attn.num_heads)
    return q, k, v


def _attn_out(attn: Any, out: Tensor, x: Tensor) -> Tensor:
    if type(attn) is AttentionCl:
        out = rearrange(out, "b h (wh ww) d -> b wh ww (h d)", wh=x.shape[1])
    else:
        out = rearrange(out, "b h (wh ww) d -> b (h d) wh ww", wh=x.shape[2])
    return attn.proj_drop(attn.proj(out))  # type: ignore[no-any-return]


def _attend(attn: Any, x: Tensor, labels: Tensor | None, reference: bool = False) -> tuple[Tensor, Tensor | None]:
    """timm's attention forward on ``x`` and ``mean_h(A_h) @ labels`` ``(b, n, l)``; with ``reference``
    the explicit head-mean matrix ``(b, n, n)`` float64 instead."""
    q, k, v = _qkv(attn, x)
    bias = attn.rel_pos.get_bias() if attn.rel_pos is not None else None  # 1 h n n
    if bias is not None and int(bias.shape[-1]) != int(k.shape[-2]):
        raise ValueError(
            f"an attention here sees {int(k.shape[-2])} tokens, but its relative position bias is for "
            f"{int(bias.shape[-1])}: timm sizes the bias from img_size at construction; {FIX}, or create the model "
            "with img_size set to yours"
        )
    dropout_p = attn.attn_drop.p if attn.training else 0.0
    if reference or not attn.fused_attn:
        scores = (q * attn.scale) @ k.transpose(-2, -1)
        a = (scores if bias is None else scores + bias).softmax(dim=-1)
        out = F.dropout(a, dropout_p) @ v if reference else attn.attn_drop(a) @ v
        mixed = a.detach().double().mean(dim=1) if reference else (None if labels is None else explicit_mix(a, labels))
    elif labels is not None:
        out, mixed = attention_with_labels(q, k, v, labels, attn.scale, dropout_p, attn_mask=bias)
    else:
        out, mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p), None
    return _attn_out(attn, out, x), mixed


def partition_sizes(grid: tuple[int, int], size: tuple[int, int], block: bool, fix: str) -> dict[str, int]:
    """The einops sizes of a block (``block``) or grid partition of ``grid`` into ``size`` windows (``wh ww``
    or ``gh gw``, and the partitions ``nh nw``); refuses grids the windows do not tile, ``fix`` saying how to."""
    ph, pw = size
    if grid[0] % ph or grid[1] % pw:
        kind = "window" if block else "grid"
        raise ValueError(f"a {grid[0]}x{grid[1]} token grid is not divisible by the {ph}x{pw} {kind} partition; {fix}")
    window = {"wh": ph, "ww": pw} if block else {"gh": ph, "gw": pw}
    return {**window, "nh": grid[0] // ph, "nw": grid[1] // pw}


def partition_axes(block: bool) -> tuple[str, str]:
    """The einops axes of a partition: the grid's ``h w`` as partitions and window positions, and one window's tokens."""
    return (BLOCK, "(wh ww)") if block else (GRID, "(gh gw)")


def partition_labels(labels: Tensor, grid: tuple[int, int], sizes: dict[str, int], block: bool) -> Tensor:
    """Labels ``(b, h*w, l)`` partitioned exactly as the tokens: ``(b*nh*nw, window tokens, l)``."""
    side, inner = partition_axes(block)
    y = rearrange(labels, "b (h w) l -> b h w l", h=grid[0])
    return rearrange(y, f"b {side} l -> (b nh nw) {inner} l", **sizes)


def departition_labels(mixed: Tensor, sizes: dict[str, int], block: bool) -> Tensor:
    """Windows' labels ``(b*nh*nw, window tokens, l)`` put back on the grid: ``(b, h*w, l)``."""
    side, inner = partition_axes(block)
    return rearrange(rearrange(mixed, f"(b nh nw) {inner} l -> b {side} l", **sizes), "b h w l -> b (h w) l")


def partition_matrix(mixed: Tensor, grid: tuple[int, int], sizes: dict[str, int], block: bool) -> Tensor:
    """Windows' explicit matrices ``(b*nh*nw, a, a)`` scattered over the grid: one ``(b, n, n)`` (the reference)."""
    side, inner = partition_axes(block)
    ids = rearrange(torch.arange(grid[0] * grid[1]).view(grid), f"{side} -> (nh nw) {inner}", **sizes)
    return window_matrix(rearrange(mixed, "(b p) n m -> b p n m", p=sizes["nh"] * sizes["nw"]), ids, grid[0] * grid[1])


def _partition(u: Any, x: Tensor, labels: Tensor | None, grid: tuple[int, int], reference: bool = False) -> tuple[Tensor, Tensor | None]:
    """A block- or grid-partition attention branch on NCHW ``x``: its output (NCHW) and the labels'
    mix ``(b, n, l)`` (with ``reference``: the explicit ``(b, n, n)`` matrix)."""
    block = bool(u.partition_block)
    size = list(u.partition_size)
    sizes = partition_sizes(grid, (size[0], size[1]), block, FIX)
    cl = isinstance(u, PartitionAttentionCl)
    h = u.norm1(rearrange(x, "b c h w -> b h w c") if cl else x)
    if cl:
        parts = window_partition(h, size) if u.partition_block else grid_partition(h, size)
    else:
        parts = window_partition_nchw(h, size) if u.partition_block else grid_partition_nchw(h, size)
    part_labels = None if labels is None else partition_labels(labels, grid, sizes, block)
    out, mixed = _attend(u.attn, parts, part_labels, reference)
    if cl:
        out = window_reverse(out, size, list(grid)) if u.partition_block else grid_reverse(out, size, list(grid))
        out = rearrange(out, "b h w c -> b c h w")
    else:
        out = window_reverse_nchw(out, size, list(grid)) if u.partition_block else grid_reverse_nchw(out, size, list(grid))
    if mixed is not None:
        mixed = partition_matrix(mixed, grid, sizes, block) if reference else departition_labels(mixed, sizes, block)
    return out, mixed


def _to_cl(u: Any, x: Tensor) -> Tensor:
    return rearrange(x, "b c h w -> b h w c") if isinstance(u, PartitionAttentionCl) else x


def _from_cl(u: Any, x: Tensor) -> Tensor:
    return rearrange(x, "b h w c -> b c h w") if isinstance(u, PartitionAttentionCl) else x


def _stem_windows(m: Any) -> tuple[Window, Window]:
    """The stem's two convs as windows: labels start on the pixels summed over both (the stride-1 conv2 too)."""
    return _window(m.stem.conv1), _window(m.stem.conv2)


def embed_stem(stem: nn.Module, stride: tuple[int, int], images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    """A conv stem of ``stride`` on the images: its output ``(b, c, h, w)``, its grid, and the grid the labels start on
    (the pixels, or the stem's grid for MixToken, which mixes the stem's output)."""
    grid = check_batch(images, label_map, stride)
    x = stem(images)
    if (int(x.shape[2]), int(x.shape[3])) != grid:
        raise ValueError(f"the stem made a {tuple(x.shape[2:])} grid, not {grid}; use an even image size")
    if label_map.token_space:
        return mix_token_space(x, label_map, channels_last=False), grid, grid
    return x, grid, (label_map.image_size[0], label_map.image_size[1])


def _check_grid(x: Tensor, grid: tuple[int, int], where: str) -> None:
    if (int(x.shape[-2]), int(x.shape[-1])) != grid:
        raise ValueError(
            f"{where}: the labels' {grid} grid does not match the tokens' {tuple(x.shape[-2:])}; use an image size "
            "whose grid stays even through every stage"
        )


def _token_logits(m: Any, x: Tensor) -> Tensor:
    """The head's classifier on every final position ``(b, h*w, classes)`` (norms per position)."""
    head = m.head
    if isinstance(head, NormMlpClassifierHead):
        t = rearrange(head.norm(x), "b c h w -> b (h w) c")
        return head.fc(head.drop(head.pre_logits(t)))  # type: ignore[no-any-return]
    return head.fc(head.drop(rearrange(x, "b c h w -> b (h w) c")))  # type: ignore[no-any-return]


def _dense_residual(rules: DenseTracker, layer: int, matrix: Tensor, pre: Tensor, keep: Tensor | None) -> None:
    """A residual branch whose labels are ``matrix @ pre``: ``pre`` the labels before the unit's
    shortcut aggregate (``DenseTracker.mix`` would read those after it)."""
    if rules.rules.wants_labels(layer):
        rules.y = rules.rules.residual(rules.y, matrix.to(rules.dtype) @ pre, keep)


class AdaptedMaxxVit(AdaptedBase):
    """A timm MaxxVit (MaxViT, CoAtNet, MaxxViT, CoAtNeXt) returning the scheme's aligned targets."""

    family = MAXXVIT_FAMILY
    refusal = staticmethod(_maxxvit_refusal)

    def reference_bytes(self, label_map: TokenLabelMap) -> int:
        """The stem matrices, this family's largest (checked by ``AdaptedBase.forward`` before they are built)."""
        m: Any = self.model
        return stem_reference_bytes(_pair(m.stem.conv1.stride), label_map)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = embed_stem(m.stem, _pair(m.stem.conv1.stride), images, label_map)
        units = _units(m)
        tracker = start_on_path(self.scheme, label_map, start, grid, len(units), _stem_windows(m))
        for layer, u in enumerate(units):
            x, grid = through_hooks(u, functools.partial(self._unit, u, grid=grid, layer=layer, tracker=tracker), x)
        x = m.norm(x)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        return tuple(_units(self.model))

    def _unit(self, u: Any, x: Tensor, grid: tuple[int, int], layer: int, tracker: LabelTracker) -> tuple[Tensor, tuple[int, int]]:
        pre = tracker.labels_for(layer)
        if isinstance(u, (PartitionAttentionCl, PartitionAttention2d)):
            out, mixed = _partition(u, x, pre, grid)
            out, keep = branch(u.drop_path1, _from_cl(u, u.ls1(_to_cl(u, out))))
            tracker.residual(layer, keep, mixed=mixed)
            x = x + out
            h = _to_cl(u, x)
            out, keep = branch(u.drop_path2, u.ls2(u.mlp(u.norm2(h))))
            tracker.residual(layer, keep, mixed=None)  # channel mixing
            return _from_cl(u, h + out), grid
        shortcut = u.shortcut(x)
        window = _shortcut_window(u)
        new_grid = grid
        if window is not None:  # the downsampling shortcut: labels summed over its pooling windows
            new_grid, g, w = window.out_grid(grid), grid, window
            tracker.aggregate(lambda y: average_windows(y, g, (w.axes(g),))[0], normalised=True)
        mixed = None
        if pre is not None:  # the branch from the labels before that aggregate
            mixed, branch_grid = _branch_labels(_branch_ops(u), pre, grid)
            if branch_grid != new_grid:
                raise ValueError(f"layer {layer}: the branch's {branch_grid} grid differs from the shortcut's {new_grid}; use an even grid")
        if isinstance(u, TransformerBlock2d):
            h = u.norm1(x)
            _check_grid(h, new_grid, f"layer {layer}")
            out, mixed = _attend(u.attn, h, mixed)
            out, keep = branch(u.drop_path1, u.ls1(out))
            tracker.residual(layer, keep, mixed=mixed)
            x = shortcut + out
            out, keep = branch(u.drop_path2, u.ls2(u.mlp(u.norm2(x))))
            tracker.residual(layer, keep, mixed=None)  # channel mixing
            return x + out, new_grid
        out, keep = branch(u.drop_path, _conv_branch(u, x))
        _check_grid(out, new_grid, f"layer {layer}")
        tracker.residual(layer, keep, mixed=mixed)
        return out + shortcut, new_grid

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit matrices (windows, kernels, attention scattered over the grid) on dense labels."""
        m: Any = self.model
        x, grid, start = embed_stem(m.stem, _pair(m.stem.conv1.stride), images, label_map)
        units = _units(m)
        rules = DenseRules(self.scheme, label_map, start, 0, len(units))
        if not label_map.token_space:
            for stem in _stem_windows(m):
                merge, start = merge_matrix(start, stem)
                rules.aggregate(merge)
        for layer, u in enumerate(units):
            pre = rules.y
            if isinstance(u, (PartitionAttentionCl, PartitionAttention2d)):
                out, matrix = _partition(u, x, None, grid, reference=True)
                out, keep = branch(u.drop_path1, _from_cl(u, u.ls1(_to_cl(u, out))))
                assert matrix is not None
                rules.mix(layer, matrix, keep)
                x = x + out
                h = _to_cl(u, x)
                x = _from_cl(u, h + branch(u.drop_path2, u.ls2(u.mlp(u.norm2(h))))[0])
                continue
            shortcut = u.shortcut(x)
            window = _shortcut_window(u)
            if window is not None:
                merge, _ = merge_matrix(grid, window)
                rules.aggregate(merge)
            matrix, grid = _branch_matrix(_branch_ops(u), grid)
            if isinstance(u, TransformerBlock2d):
                out, attn = _attend(u.attn, u.norm1(x), None, reference=True)
                assert attn is not None
                out, keep = branch(u.drop_path1, u.ls1(out))
                _dense_residual(rules, layer, attn @ matrix, pre, keep)
                x = shortcut + out
                x = x + branch(u.drop_path2, u.ls2(u.mlp(u.norm2(x))))[0]
            else:
                out, keep = branch(u.drop_path, _conv_branch(u, x))
                _dense_residual(rules, layer, matrix.unsqueeze(0), pre, keep)
                x = out + shortcut
        x = m.norm(x)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


FAMILY = Family(
    name="maxxvit",
    description=MAXXVIT_FAMILY,
    refusal=AdaptedMaxxVit.refusal,
    build=AdaptedMaxxVit,
    example=tiny(MaxxVit, img_size=32, cfg=MaxxVitCfg(embed_dim=(8, 16, 32), depths=(1, 1, 1), block_type=("C", "M", "T"),
        stem_width=8, transformer_cfg=MaxxVitTransformerCfg(dim_head=8, window_size=(2, 2)))),
    timm_modules=("maxxvit",),
    speed_model="maxvit_pico_rw_256",
)
