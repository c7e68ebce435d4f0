"""Adapter for timm's EfficientViT (MIT): conv blocks and ReLU linear attention (LiteMLA).

TL-Align Table 10 and Appendix D extended by the same reasoning as for ConvNeXt and
MetaFormer. The model is a CNN with attention in its last stages, no patch tokens and no
stochastic depth. Events, with ``layer`` counting every residual block (the stem's, the
stages' and each ``EfficientVitBlock``, whose two residuals share one index):

- convolutions: a 1x1 conv (``inverted_conv``, ``point_conv``, ``qkv``, ``proj``), a batch
  norm (per-channel statistics shared by every token) and an activation mix channels
  only. A stride-1 spatial conv (the depthwise ``depth_conv`` of DSConv/MBConv, the full
  ``spatial_conv`` of FusedMBConv, ``conv1`` then ``conv2`` of ConvBlock) mixes labels by
  ``Norm(T(K)) Y`` with ``K`` its normalised absolute kernels averaged over channel
  pairs (``backbones._common.conv_mix``; a ConvBlock applies its two in order), as one
  ``residual(layer, None, mixed=...)``. Each stage's first block has no shortcut and a
  strided spatial conv: ``aggregate`` sums the labels under every window, as does the
  stem's strided ``in_conv`` (labels start on the pixels; a MixToken map starts on the
  ``in_conv`` grid, where tokens are mixed).
- ``LiteMLA``: per head ``out_i = sum_j (relu(q_i).relu(k_j)) v_j / (sum_j relu(q_i).relu(k_j) + eps)``.
  The weights are non-negative, so their normalised absolute values are
  ``A_ij = relu(q_i).relu(k_j) / sum_j relu(q_i).relu(k_j)`` (eps dropped: the exact row
  normalisation), computed linearly: ``(relu(q) (relu(k)^T Z)) / (relu(q) sum_j relu(k_j))``,
  no ``(n, n)`` matrix. The multi-scale heads first pass q, k and v through a depthwise
  conv (then a grouped 1x1, a channel op within each head's q, k or v). Labels follow the
  values, which is what the output is made of; q and k only set the weights, so their
  convs move no label (as a ViT's q and k projections do not). A scale head's values are
  a depthwise conv of the head's v, so its labels are ``Z_h = Norm(T(K_v,h)) Y`` with
  ``K_v,h`` the head's v channels' kernels, and the head mixes ``A_h Z_h``; the original
  heads mix ``A_h Y``. The branch: ``mean_h`` over all heads. A head whose weights are all
  zero (every ``relu(q_i).relu(k_j) = 0``) adds nothing to the output, and its row is the
  token's own labels.
- readout: ``pool("mean", 0)`` (global average pooling; no class token: TransMix refuses).

Shapes: ``b`` batch, ``g`` heads, ``n`` tokens, ``d`` head dim, ``l`` label channels, ``h w`` grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.models.efficientvit_mit import (
    ConvBlock,
    DSConv,
    EfficientVit,
    EfficientVitBlock,
    EfficientVitLarge,
    FusedMBConv,
    LiteMLA,
    MBConv,
    ResidualBlock,
)
from torch import Tensor, nn

from mixlabels._label_map import fp32_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, conv_aggregate, mix_token_space, shifted_mix, shifted_route, start_on_stem, tap_weights
from mixlabels.backbones._convnet import Kernels, fold_labels, residual_labels
from mixlabels.backbones._windows import as_grid
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise
from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedEfficientViTMIT", "EFFICIENTVIT_MIT_FAMILY", "linear_attention_labels", "head_conv_mix"]

EFFICIENTVIT_MIT_FAMILY = (
    "timm EfficientViT (MIT; B and L series): stride-1 spatial convs of DSConv/MBConv/FusedMBConv/ConvBlock as "
    "normalised-absolute-kernel spatial mixes, strided stem and downsampling convs as aggregation, LiteMLA ReLU "
    "linear attention mixing labels by its exact normalised weights (multi-scale heads: their values' depthwise "
    "conv applied to the labels first); 1x1 convs, batch norms as channel ops; global average pooling"
)

_LOCAL = (DSConv, MBConv, FusedMBConv, ConvBlock)


def _spatial_convs(block: Any) -> list[Any]:
    """A local block's spatial convs, in order; its other convs are 1x1 (checked in the refusal)."""
    if type(block) in (DSConv, MBConv):
        return [block.depth_conv.conv]
    if type(block) is FusedMBConv:
        return [block.spatial_conv.conv]
    return [block.conv1.conv, block.conv2.conv]


def _pointwise_convs(block: Any) -> list[Any]:
    names = {DSConv: ("point_conv",), MBConv: ("inverted_conv", "point_conv"), FusedMBConv: ("point_conv",), ConvBlock: ()}
    return [getattr(block, name).conv for name in names[type(block)]]


def _conv_why(conv: Any, what: str) -> str | None:
    if type(conv) is not nn.Conv2d:
        return f"{what} is {type(conv).__name__}, not a plain nn.Conv2d"
    if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        return f"{what} uses padding {conv.padding!r} ({conv.padding_mode}); only static zero padding is supported"
    return None


def _local_why(block: Any, where: str, residual: bool) -> str | None:
    if type(block) not in _LOCAL:
        return f"{where} is {type(block).__name__}; only DSConv, MBConv, FusedMBConv and ConvBlock are supported"
    for conv in _pointwise_convs(block):
        why = _conv_why(conv, f"{where}'s 1x1 conv")
        if why is None and (conv.kernel_size != (1, 1) or conv.stride != (1, 1)):
            why = f"{where}'s pointwise conv is {conv.kernel_size} stride {conv.stride}, not a 1x1 channel op"
        if why is not None:
            return why
    convs = _spatial_convs(block)
    for conv in convs:
        why = _conv_why(conv, f"{where}'s spatial conv")
        if why is not None:
            return why
    strides = [tuple(c.stride) for c in convs]
    if residual and any(s != (1, 1) for s in strides):
        return f"{where} is a residual block with a strided conv; its output grid would not match the shortcut"
    if not residual and (len(convs) != 1 or convs[0].dilation != (1, 1)):
        return f"{where} has no shortcut: only one undilated (strided) spatial conv, an aggregation, is supported there"
    return None


def _mla_why(mla: Any, where: str) -> str | None:
    if type(mla.kernel_func) is not nn.ReLU:
        return f"{where}'s LiteMLA kernel_func is {type(mla.kernel_func).__name__}; only ReLU (non-negative weights) is supported"
    for what, conv in (("qkv", mla.qkv.conv), ("proj", mla.proj.conv)):
        if _conv_why(conv, f"{where}'s {what}") or conv.kernel_size != (1, 1) or conv.stride != (1, 1):
            return f"{where}'s LiteMLA {what} must be a 1x1 stride-1 nn.Conv2d"
    for op in mla.aggreg:
        dw, pw = op[0], op[1]
        if _conv_why(dw, "aggreg") or dw.groups != dw.in_channels or dw.stride != (1, 1) or _conv_why(pw, "aggreg") or pw.kernel_size != (1, 1):
            return f"{where}'s LiteMLA multi-scale aggregation must be a stride-1 depthwise nn.Conv2d then a 1x1 nn.Conv2d"
    return None


def _efficientvit_mit_refusal(model: nn.Module) -> str | None:
    if type(model) not in (EfficientVit, EfficientVitLarge):
        return f"{type(model).__name__} is not a timm EfficientVit or EfficientVitLarge (MIT)"
    m: Any = model
    if m.head.global_pool.pool_type != "avg":
        return f"global_pool={m.head.global_pool.pool_type!r} has no label readout; use 'avg'"
    if not isinstance(m.head.in_conv, nn.Identity) and (_conv_why(m.head.in_conv.conv, "head") or m.head.in_conv.conv.kernel_size != (1, 1)):
        return "the head's in_conv must be a 1x1 nn.Conv2d (a channel op)"
    why = _conv_why(m.stem.in_conv.conv, "the stem's in_conv")
    if why is not None:
        return why
    blocks = [(f"stem block {i}", blk) for i, blk in enumerate(list(m.stem)[1:])]
    blocks += [(f"stage {i} block {j}", blk) for i, stage in enumerate(m.stages) for j, blk in enumerate(stage.blocks)]
    for where, blk in blocks:
        if type(blk) is EfficientVitBlock:
            for sub in (blk.context_module, blk.local_module):
                if type(sub) is not ResidualBlock or not isinstance(sub.shortcut, nn.Identity) or not isinstance(sub.pre_norm, nn.Identity):
                    return f"{where}'s context/local modules must be ResidualBlocks with identity shortcut and no pre_norm"
            why = _mla_why(blk.context_module.main, where) if type(blk.context_module.main) is LiteMLA else f"{where}'s context module is not LiteMLA"
            why = why or _local_why(blk.local_module.main, f"{where}'s local module", residual=True)
        elif type(blk) is ResidualBlock and isinstance(blk.pre_norm, nn.Identity) and (blk.shortcut is None or isinstance(blk.shortcut, nn.Identity)):
            why = _local_why(blk.main, where, residual=blk.shortcut is not None)
        else:
            why = f"{where} is {type(blk).__name__}; only ResidualBlock (identity or no shortcut, no pre_norm) and EfficientVitBlock are supported"
        if why is not None:
            return why
    return None


def linear_attention_labels(q: Tensor, k: Tensor, values: Tensor, labels: Tensor, ones_column: bool | None = None) -> Tensor:
    """``mean_g(A_g Z_g)`` for ReLU linear attention, ``A_g`` its exactly normalised weights, without ``(n, n)``.

    Args:
        q, k: ``(b, g, n, d)`` non-negative (after the kernel function).
        values: ``(b, g, n, l)`` each head's value labels ``Z_g``.
        labels: ``(b, n, l)`` the tokens' own labels: the row of a head whose weights are all zero.
        ones_column: how the row sums ``relu(q_i) sum_j relu(k_j)`` are formed. ``True``: a ones column on the values,
            so that the numerators' two products give them too (timm's own attention pads its values so; eager: one
            operator where a sum and a third product are three). ``False``: the keys' sum and a product of their own,
            which a compiler fuses where the column's pad is one more generated kernel a block. ``None``: the first
            in eager mode, the second while traced.

    Returns:
        ``(b, n, l)`` fp32.
    """
    with torch.no_grad(), fp32_labels(q.device):
        b, g, n, d = (int(s) for s in q.shape)
        # heads folded into the batch: ``bmm`` dispatches one operator where a 4-d ``@`` dispatches about six; no
        # detach (no graph is recorded here)
        q3, k3 = q.float().reshape(b * g, n, d), k.float().reshape(b * g, n, d)
        v3 = values.float().reshape(b * g, n, -1)
        if ones_column is None:
            ones_column = not torch.compiler.is_compiling()
        if ones_column:
            both = torch.bmm(q3, torch.bmm(k3.transpose(1, 2), F.pad(v3, (0, 1), value=1.0))).view(b, g, n, -1)
            num, den = torch.split(both, [int(v3.shape[-1]), 1], dim=-1)  # b g n l, b g n 1: one view for both
        else:
            num = torch.bmm(q3, torch.bmm(k3.transpose(1, 2), v3)).view(b, g, n, -1)
            den = torch.bmm(q3, k3.sum(dim=1).unsqueeze(-1)).view(b, g, n, 1)
        # a zero row's 0 / 0 is not taken; the token's own labels broadcast over the heads
        return torch.where(den > 0, num / den, labels.float().unsqueeze(1)).mean(dim=1)


def _v_kernels(mla: Any, conv: nn.Conv2d, dtype: torch.dtype) -> Tensor:
    """Each head's value-channel kernels of a multi-scale depthwise conv as one distribution ``(g, kh, kw)``."""
    with torch.no_grad():  # no graph, and no detach dispatched
        w = rearrange(conv.weight.to(dtype).abs(), "(g three d) 1 kh kw -> g three d kh kw", three=3, d=mla.dim)[:, 2]
        return (w / w.sum(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(dtype).tiny)).mean(dim=1)


def value_kernels(convs: Sequence[tuple[int, nn.Conv2d]]) -> list[Tensor]:
    """``_v_kernels`` of many multi-scale depthwise convs ``(head dim, conv)`` at once, fp32 ``(g, 1, kh, kw)`` each
    (the weight layout ``F.conv2d`` reads, so that ``head_conv_mix`` views none), in order: the value channels of
    every conv of one head dim and kernel size in one stack, reduced together (about six operators a stack where
    ``_v_kernels`` takes five a conv), the same bits as conv by conv."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, (d, conv) in enumerate(convs):
        groups.setdefault((d, int(conv.weight.shape[-2]), int(conv.weight.shape[-1])), []).append(i)
    out: list[Tensor | None] = [None] * len(convs)
    with torch.no_grad():  # no graph, and no detach dispatched
        for (d, _, _), members in groups.items():
            parts = [_value_channels(convs[i][1].weight, d) for i in members]
            w = torch.cat(parts).float().abs_()  # G d kh kw: a new tensor (one conv's too), so abs in place
            means = w.div_(w.sum(dim=(-2, -1), keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)).mean(dim=1, keepdim=True)
            for i, kernels in zip(members, torch.split(means, [int(p.shape[0]) for p in parts])):
                out[i] = kernels
    return [k for k in out if k is not None]


def _value_channels(weight: Tensor, d: int) -> Tensor:
    """``rearrange(weight, "(g three d) 1 kh kw -> g three d kh kw")[:, 2]``: each head's ``d`` value channels of a
    multi-scale depthwise conv's weight ``(g 3 d, 1, kh, kw)``, ``(g, d, kh, kw)``; one strided view of a contiguous
    weight in eager mode (the rearrange and the index dispatch two; a traced graph reads no storage offset, and its
    views cost nothing)."""
    if torch.compiler.is_compiling() or not weight.is_contiguous():
        return rearrange(weight, "(g three d) 1 kh kw -> g three d kh kw", three=3, d=d)[:, 2]
    kh, kw = int(weight.shape[-2]), int(weight.shape[-1])
    g = int(weight.shape[0]) // (3 * d)
    return weight.as_strided((g, d, kh, kw), (3 * d * kh * kw, kh * kw, kw, 1), weight.storage_offset() + 2 * d * kh * kw)


class _ValueKernels:
    """The value kernels of a forward's LiteMLA blocks (``value_kernels``), computed together on the first read: not at
    all where no labels move (``NoAlign``)."""

    def __init__(self, mlas: Sequence[Any]) -> None:
        self._convs = [(int(mla.dim), op[0]) for mla in mlas for op in mla.aggreg]
        self._kernels: dict[nn.Module, Tensor] | None = None

    def get(self, conv: nn.Module) -> Tensor:
        if self._kernels is None:
            self._kernels = {c: k for (_, c), k in zip(self._convs, value_kernels(self._convs), strict=True)}
        return self._kernels[conv]


def head_conv_mix(labels: Tensor, grid: tuple[int, int], kernels: Tensor, padding: tuple[int, int], dilation: tuple[int, int]) -> Tensor:
    """``Norm(T(K_g)) Y`` for every head's kernel ``(g, 1, kh, kw)`` (``value_kernels``'): ``(b, n, l) -> (b, g, n, l)``
    fp32, border-renormalised."""
    with fp32_labels(labels.device):
        b, l = int(labels.shape[0]), int(labels.shape[-1])
        # the labels as ``b l`` one-channel maps: one copy (einops' reshape of the permuted view dispatches a second
        # operator, ``_unsafe_view``, after it)
        y = as_grid(labels.float(), grid).contiguous().view(b * l, 1, grid[0], grid[1])
        k = kernels.float()
        if shifted_route(k):  # compiled: shifted sums, fused (see ``shifted_conv``); a traced view costs nothing
            return _by_head(shifted_mix(y, rearrange(k, "g 1 kh kw -> g kh kw"), padding, dilation), b)
        mass = tap_weights(k, grid, padding, dilation)  # 1 g h w
        return _by_head(F.conv2d(y, k, padding=padding, dilation=dilation).div_(mass), b)  # in place: see conv_steps_on_grid


def _by_head(mixed: Tensor, batch: int) -> Tensor:
    """``rearrange(mixed, "(b l) g h w -> b g (h w) l")`` as one strided view where ``h`` and ``w`` merge (a conv's
    output), einops otherwise."""
    bl, g, h, w = (int(s) for s in mixed.shape)
    sbl, sg, sh, sw = mixed.stride()
    if sh != sw * w:
        return rearrange(mixed, "(b l) g h w -> b g (h w) l", b=batch)
    return mixed.as_strided((batch, g, h * w, bl // batch), (bl // batch * sbl, sg, sw, sbl))


def _mla_qkv(mla: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """timm's multi-scale q, k (after ReLU) and v (padded with ones), all heads ``(b, g, n, d)``."""
    qkv = mla.qkv(x)
    multi = torch.cat([qkv] + [op(qkv) for op in mla.aggreg], dim=1)
    multi = rearrange(multi, "b (g e) h w -> b g (h w) e", e=3 * mla.dim)
    q, k, v = multi.chunk(3, dim=-1)
    return mla.kernel_func(q), mla.kernel_func(k), F.pad(v, (0, 1), mode="constant", value=1.0)


def _mla_out(mla: Any, q: Tensor, k: Tensor, v: Tensor, grid: tuple[int, int]) -> Tensor:
    with fp32_labels(v.device):
        out = mla._attn(q, k, v)  # timm's own linear attention
    return mla.proj(rearrange(out, "b g (h w) d -> b (g d) h w", h=grid[0]))  # type: ignore[no-any-return]


def _mla_values(mla: Any, labels: Tensor, grid: tuple[int, int], kernels: _ValueKernels) -> Tensor:
    """Every head's value labels ``(b, g, n, l)``: ``Y`` for the original heads, then each scale's conv of it
    (``kernels``: the forward's value kernels)."""
    heads = mla.qkv.conv.out_channels // (3 * mla.dim)
    parts = [_repeat_heads(labels.float(), heads)]
    for op in mla.aggreg:
        conv = op[0]
        parts.append(head_conv_mix(labels, grid, kernels.get(conv), conv.padding, conv.dilation))
    return torch.cat(parts, dim=1)


def _repeat_heads(labels: Tensor, heads: int) -> Tensor:
    """``labels.unsqueeze(1).expand(-1, heads, -1, -1)``: ``(b, n, l) -> (b, heads, n, l)`` as one strided view (the
    unsqueeze and the expand dispatch two)."""
    b, n, l = (int(s) for s in labels.shape)
    sb, sn, sl = labels.stride()
    return labels.as_strided((b, heads, n, l), (sb, 0, sn, sl))  # the storage offset: the input's


def _local_blocks(m: Any) -> list[Any]:
    """Every block whose spatial convs mix labels (a residual local block: an EfficientVitBlock's local module, an
    MBConv or DSConv with a shortcut), in order."""
    return [blk.local_module.main if type(blk) is EfficientVitBlock else blk.main for blk in _blocks(m)
            if type(blk) is EfficientVitBlock or blk.shortcut is not None]


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    """The stem's ``in_conv`` output ``(b, c, h, w)``, its grid, and the grid the labels start on."""
    conv = m.stem.in_conv.conv
    grid = check_batch(images, label_map, tuple(conv.stride))
    x = m.stem.in_conv(images)
    if (int(x.shape[2]), int(x.shape[3])) != grid:
        raise ValueError(f"the stem made a {tuple(x.shape[2:])} grid, not {grid}; use an even image size")
    if label_map.token_space:
        return mix_token_space(x, label_map, channels_last=False), grid, grid
    return x, grid, (label_map.image_size[0], label_map.image_size[1])


def _blocks(m: Any) -> list[Any]:
    return list(m.stem)[1:] + [blk for stage in m.stages for blk in stage.blocks]


def _depth(m: Any) -> int:
    return sum(1 for blk in _blocks(m) if type(blk) is EfficientVitBlock or blk.shortcut is not None)


def _heads(m: Any, x: Tensor) -> Tensor:
    """The classifier on every final position ``(b, h*w, classes)``: 1x1 conv, then per-token layers."""
    return m.head.classifier(rearrange(m.head.in_conv(x), "b c h w -> b (h w) c"))  # type: ignore[no-any-return]


class AdaptedEfficientViTMIT(AdaptedBase):
    """A timm EfficientViT (MIT) returning the scheme's aligned targets."""

    family = EFFICIENTVIT_MIT_FAMILY
    refusal = staticmethod(_efficientvit_mit_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        tracker = start_on_stem(self.scheme, label_map, start, grid, _depth(m), m.stem.in_conv.conv)
        kernels = Kernels(conv for block in _local_blocks(m) for conv in _spatial_convs(block))  # computed together
        values = _ValueKernels([blk.context_module.main for blk in _blocks(m) if type(blk) is EfficientVitBlock])
        layer = 0
        for blk in _blocks(m):
            if type(blk) is EfficientVitBlock:
                x = self._attention(blk.context_module.main, x, layer, tracker, grid, values)
                x = self._local(blk.local_module.main, x, layer, tracker, grid, kernels)
            elif blk.shortcut is None:  # a stage's first block: strided, no shortcut
                grid = conv_aggregate(tracker, grid, _spatial_convs(blk.main)[0])
                x = blk.main(x)
                continue
            else:
                x = self._local(blk.main, x, layer, tracker, grid, kernels)
            layer += 1
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _heads(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    @staticmethod
    def _local(block: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int], kernels: Kernels) -> Tensor:
        labels = fold_labels(tracker, layer, grid)  # position-major where the CPU's folded convs pay
        # the residual's mean folded into the convs' matrices on a GPU's small grids (else the convs' map and a ``lerp``)
        residual_labels(tracker, layer, None, labels, tuple(_spatial_convs(block)), grid, kernels)
        return block(x) + x  # type: ignore[no-any-return]

    @staticmethod
    def _attention(mla: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int], values: _ValueKernels) -> Tensor:
        q, k, v = _mla_qkv(mla, x)
        out = _mla_out(mla, q, k, v, grid)
        labels, mixed = tracker.labels_for(layer), None
        if labels is not None:
            mixed = linear_attention_labels(q, k, _mla_values(mla, labels, grid, values), labels)
        tracker.residual(layer, None, mixed=mixed)
        return out + x

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit ``(n, n)`` attention and convolution matrices and ``(n', n)`` merges on dense labels."""
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        rules = DenseRules(self.scheme, label_map, start, 0, _depth(m))
        if start != grid:
            stem = m.stem.in_conv.conv
            rules.aggregate(conv_matrix(start, torch.ones(stem.kernel_size), stem.stride, stem.padding)[0])
        layer = 0
        for blk in _blocks(m):
            if type(blk) is EfficientVitBlock:
                mla: Any = blk.context_module.main
                local: Any = blk.local_module.main
                rules.mix(layer, _mla_matrix(mla, x, grid), None)
                x = mla(x) + x  # timm's own forward
                rules.mix(layer, _local_matrix(local, grid).unsqueeze(0), None)
                x = local(x) + x
            elif blk.shortcut is None:
                conv = _spatial_convs(blk.main)[0]
                merge, grid = conv_matrix(grid, torch.ones(conv.kernel_size), conv.stride, conv.padding)
                rules.aggregate(merge)
                x = blk.main(x)
                continue
            else:
                rules.mix(layer, _local_matrix(blk.main, grid).unsqueeze(0), None)
                x = blk.main(x) + x
            layer += 1
        output = m.forward_head(x)
        token_logits = _heads(m, x) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


def _conv_matrix_normalised(grid: tuple[int, int], weight: Tensor, padding: Any, dilation: Any) -> Tensor:
    kernel = kernel_reference(weight)
    return row_normalise(conv_matrix(grid, kernel, padding=padding, dilation=dilation)[0])


def _local_matrix(block: Any, grid: tuple[int, int]) -> Tensor:
    """The local block's spatial convs as one ``(n, n)`` matrix: each normalised, applied in order."""
    n = grid[0] * grid[1]
    matrix = torch.eye(n, dtype=torch.float64)
    for conv in _spatial_convs(block):
        matrix = _conv_matrix_normalised(grid, conv.weight, conv.padding, conv.dilation) @ matrix
    return matrix


def _mla_matrix(mla: Any, x: Tensor, grid: tuple[int, int]) -> Tensor:
    """``mean_g`` of every head's normalised weights ``(b, n, n)``, times its value conv's matrix for scale heads."""
    with torch.no_grad():
        q, k, _ = _mla_qkv(mla, x)
    w = q.double() @ k.double().transpose(-1, -2)  # b g n n, non-negative
    sums = w.sum(dim=-1, keepdim=True)
    eye = torch.eye(w.shape[-1], dtype=torch.float64)
    a = torch.where(sums > 0, w / sums.clamp_min(1e-300), eye)
    heads = mla.qkv.conv.out_channels // (3 * mla.dim)
    values = [eye.expand(heads, -1, -1)]
    for op in mla.aggreg:
        conv = op[0]
        kernels = _v_kernels(mla, conv, torch.float64)
        values.append(torch.stack([row_normalise(conv_matrix(grid, kern, padding=conv.padding, dilation=conv.dilation)[0]) for kern in kernels]))
    # a zero-weight head's row is the token's own label, not its value conv's mix
    mixed = torch.where(sums > 0, a @ torch.cat(values), eye)
    return mixed.mean(dim=1)


FAMILY = Family(
    name="efficientvit_mit",
    description=EFFICIENTVIT_MIT_FAMILY,
    refusal=AdaptedEfficientViTMIT.refusal,
    build=AdaptedEfficientViTMIT,
    example=tiny("efficientvit_b0", widths=(8, 16, 16, 32), depths=(1, 1, 1, 1), head_dim=8, head_widths=(32, 32)),
    timm_modules=("efficientvit_mit",),
    speed_model="efficientvit_b0",
)
