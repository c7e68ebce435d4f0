"""Adapter for torchvision's SwinTransformer, v1 and v2 (swin_t/s/b, swin_v2_t/s/b).

The rules of timm's Swin families (``backbones.families.swin``, whose window shift and
partition of the labels this reuses, and ``swinv2``, whose cosine logits it reuses) on
torchvision's modules. torchvision's ``shifted_window_attention`` differs from timm's in two
ways, both reproduced or refused here:

- it pads a grid to a multiple of the window with zero tokens that every window's queries
  attend to, with no mask: such tokens carry no label, so a grid the windows do not tile is
  refused per input, naming an image size that tiles (as is an odd grid at a patch merging,
  which torchvision pads too);
- it drops the shift along an axis where one window covers the whole grid, and builds the
  shift mask (0 / -100 between a window's regions) in every forward from the shift it keeps.

Events per block ``layer`` (blocks counted over all stages):

- window attention: ``residual(layer, keep, mixed=mean_h(A_h) Y)`` with ``Y = labels_for(layer)``
  mixed inside every (shifted) window by torchvision's own attention matrix: v1 ``q k^T / sqrt(d)``
  plus the relative position bias, v2 ``cos(q, k) s_h`` (logit scale clamped at 100) plus ``16
  sigmoid(cpb_mlp)``, then the shift mask; ``keep`` is the block's ``StochasticDepth`` draw;
- MLP: ``residual(layer, keep, mixed=None)`` (channel mixing); v2's post-norms
  (``x + sd(norm(branch(x)))``) are channel ops on the branch;
- patch merging (``PatchMerging`` or v2's ``PatchMergingV2``): ``aggregate`` summing every 2x2 group;
- readout: ``pool("mean", 0)`` (``norm``, ``permute``, ``avgpool``, ``flatten``, ``head``; no class token).

Shapes: ``b`` batch, ``h w`` token grid, ``nw`` windows, ``n m`` tokens in a window, ``c``
channels, ``l`` label channels, ``hd`` heads, ``d`` head dim.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import Tensor, nn
from torchvision.models.swin_transformer import (
    PatchMerging,
    PatchMergingV2,
    ShiftedWindowAttention,
    ShiftedWindowAttentionV2,
    SwinTransformer,
    SwinTransformerBlock,
    SwinTransformerBlockV2,
)
from torchvision.ops import StochasticDepth
from torchvision.ops.misc import MLP, Permute

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels._shape_cache import shape_cache
from mixlabels.backbones._attention import explicit_mix
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, mix_token_space, stride_grid, mean_pool_merge
from mixlabels.backbones._dense import DenseRules, conv_matrix, window_matrix
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks
from mixlabels.backbones.families.swin import shifted_windows, window_ids
from mixlabels.backbones.families.swinv2 import cosine_scores
from mixlabels.backbones.families.tv_resnet import adaptive_avgpool_refusal

__all__ = ["AdaptedTvSwin", "TV_SWIN_FAMILY", "tv_swin_refusal", "tv_window_attention", "kept_shift", "shift_mask"]

TV_SWIN_FAMILY = (
    "torchvision SwinTransformer v1 and v2 (swin_t/s/b, swin_v2_t/s/b; window attention with relative position "
    "bias, or v2's cosine attention with logit scale and continuous position bias; shift mask; pre- or post-norm; "
    "PatchMerging or PatchMergingV2; global average pooling; stochastic depth; every stage's grid divisible by its "
    "window)"
)

BUILDERS = ("swin_t", "swin_s", "swin_b", "swin_v2_t", "swin_v2_s", "swin_v2_b")

_BLOCKS = (SwinTransformerBlock, SwinTransformerBlockV2)
_ATTENTIONS = (ShiftedWindowAttention, ShiftedWindowAttentionV2)
_MERGES = (PatchMerging, PatchMergingV2)
_MLP_LAYERS = (nn.Linear, nn.GELU, nn.Dropout)


def _block_refusal(blk: Any, where: str) -> str | None:
    if type(blk) not in _BLOCKS:
        return f"{where} is {type(blk).__name__}, not torchvision's SwinTransformerBlock or SwinTransformerBlockV2"
    attn = blk.attn
    if type(attn) not in _ATTENTIONS:
        return f"{where}'s attention is {type(attn).__name__}, not torchvision's ShiftedWindowAttention(V2)"
    window, shift = list(attn.window_size), list(attn.shift_size)
    if len(window) != 2 or len(shift) != 2 or not all(0 <= s < w for s, w in zip(shift, window)):
        return f"{where} has window {window} and shift {shift}; a shift must lie in [0, window) on both axes"
    if type(blk.norm1) is not nn.LayerNorm or type(blk.norm2) is not nn.LayerNorm:
        return f"{where}'s norms are {type(blk.norm1).__name__}/{type(blk.norm2).__name__}; only nn.LayerNorm (per token)"
    if type(blk.mlp) is not MLP or not all(type(mod) in _MLP_LAYERS for mod in blk.mlp):
        return f"{where}'s MLP is not torchvision's (Linear, GELU, Dropout): it may mix tokens"
    if type(blk.stochastic_depth) is not StochasticDepth:
        return f"{where}'s stochastic depth is {type(blk.stochastic_depth).__name__}, not torchvision's StochasticDepth"
    return None


def tv_swin_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a torchvision Swin this adapter carries labels through (``None``: it is)."""
    if type(model) is not SwinTransformer:
        return f"{type(model).__name__} is not a torchvision SwinTransformer"
    m: Any = model
    stem = list(m.features[0])
    conv: Any = stem[0] if stem else None
    if (
        [type(mod) for mod in stem] != [nn.Conv2d, Permute, nn.LayerNorm]
        or conv.kernel_size != conv.stride or conv.padding != (0, 0) or conv.dilation != (1, 1)
    ):
        return "the stem is not torchvision's patch embedding (Conv2d with kernel == stride, no padding; Permute; LayerNorm)"
    head = [m.norm, m.permute, m.flatten]
    if [type(mod) for mod in head] != [nn.LayerNorm, Permute, nn.Flatten] or list(m.permute.dims) != [0, 3, 1, 2]:
        return "the head is not torchvision's (LayerNorm, Permute to channels-first, pool, Flatten, Linear)"
    why = adaptive_avgpool_refusal(m.avgpool, m.head, "the head")
    for i, unit in enumerate(list(m.features)[1:]):
        if why is not None:
            return why
        if isinstance(unit, _MERGES):
            if type(unit) not in _MERGES or type(unit.norm) is not nn.LayerNorm:
                why = f"feature {i + 1} is {type(unit).__name__} with {type(unit.norm).__name__}; only PatchMerging(V2) with nn.LayerNorm"
            continue
        if type(unit) is not nn.Sequential:
            why = f"feature {i + 1} is {type(unit).__name__}, neither a stage of blocks nor PatchMerging(V2)"
            continue
        for j, blk in enumerate(unit):
            why = why or _block_refusal(blk, f"feature {i + 1}'s block {j}")
    return why


def _tiling_size(m: Any, image: tuple[int, int], patch: tuple[int, int]) -> tuple[int, int]:
    """The smallest image size at least ``image`` whose grids every window tiles and every merge halves evenly."""
    size = []
    for axis in (0, 1):
        need, scale = 1, 1  # the patch-grid length must be a multiple of ``need``
        for unit in list(m.features)[1:]:
            if isinstance(unit, _MERGES):
                need, scale = math.lcm(need, 2 * scale), 2 * scale
            else:
                for blk in unit:
                    need = math.lcm(need, blk.attn.window_size[axis] * scale)
        step = patch[axis] * need
        size.append(-(-image[axis] // step) * step)
    return size[0], size[1]


def _check_grids(m: Any, grid: tuple[int, int], image: tuple[int, int], patch: tuple[int, int]) -> None:
    """Refuse an input torchvision would pad: padded zero tokens join every window's keys with no mask and no label."""
    h, w = grid
    stage = 0
    for unit in list(m.features)[1:]:
        if isinstance(unit, _MERGES):
            if h % 2 or w % 2:
                th, tw = _tiling_size(m, image, patch)
                raise ValueError(
                    f"{image[0]}x{image[1]} images give the patch merging before stage {stage} a {h}x{w} grid, which "
                    f"torchvision pads with zero tokens that carry no label; use an image size whose grids tile, e.g. {th}x{tw}"
                )
            h, w = h // 2, w // 2
            continue
        for blk in unit:
            wh, ww = blk.attn.window_size
            if h % wh or w % ww:
                th, tw = _tiling_size(m, image, patch)
                raise ValueError(
                    f"{image[0]}x{image[1]} images give stage {stage} a {h}x{w} grid, not divisible by its {wh}x{ww} "
                    "windows: torchvision would pad it with zero tokens that every window attends to and that carry "
                    f"no label; use an image size whose grids every window tiles, e.g. {th}x{tw}"
                )
        stage += 1


def kept_shift(grid: tuple[int, int], window: tuple[int, int], shift: Any) -> tuple[int, int]:
    """torchvision's shift on a tiled grid: none along an axis that one window covers whole."""
    return (0 if window[0] >= grid[0] else int(shift[0]), 0 if window[1] >= grid[1] else int(shift[1]))


@shape_cache(maxsize=64)
def _regions(grid: tuple[int, int], window: tuple[int, int], shift: tuple[int, int], device: torch.device) -> Tensor:
    """``(nw, n)``: each shifted window's tokens' region, torchvision's slices ``[0, -w)``, ``[-w, -s)``, ``[-s, :)`` per
    axis (one region where the shift is 0); a constant of the shapes, cached (``torch.compile`` traces it in)."""
    per_axis = []
    for size, w, s in zip(grid, window, shift):
        pos = torch.arange(size, device=device)
        per_axis.append((pos >= size - w).long() + (pos >= size - s).long() if s else torch.zeros_like(pos))
    ids = per_axis[0][:, None] * 3 + per_axis[1][None, :]  # h w
    return rearrange(ids, "(nh wh) (nw ww) -> (nh nw) (wh ww)", wh=window[0], ww=window[1])


def shift_mask(grid: tuple[int, int], window: tuple[int, int], shift: tuple[int, int], like: Tensor) -> Tensor:
    """torchvision's shift mask ``(nw, n, m)`` in ``like``'s dtype: -100 between tokens of different regions, else 0."""
    regions = _regions(grid, window, shift, like.device)
    apart = regions[:, None, :] != regions[:, :, None]
    return torch.zeros(apart.shape, dtype=like.dtype, device=like.device).masked_fill_(apart, -100.0)


def _qkv(attn: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """torchvision's projections ``(b, hd, n, d)`` each; v2 zeroes the key bias in every forward."""
    bias = attn.qkv.bias
    if isinstance(attn, ShiftedWindowAttentionV2) and bias is not None:
        third = bias.numel() // 3
        bias = torch.cat((bias[:third], torch.zeros_like(bias[third : 2 * third]), bias[2 * third :]))
    q, k, v = rearrange(F.linear(x, attn.qkv.weight, bias), "b n (three hd d) -> three b hd n d", three=3, hd=attn.num_heads)
    return q, k, v


def _scores(attn: Any, q: Tensor, k: Tensor) -> Tensor:
    """torchvision's attention logits before the shift mask ``(b nw, hd, n, m)``, in its order of operations."""
    bias: Tensor = attn.get_relative_position_bias()  # 1 hd n m
    if isinstance(attn, ShiftedWindowAttentionV2):
        logit_scale = torch.clamp(attn.logit_scale, max=math.log(100.0)).exp()  # hd 1 1
        return cosine_scores(q, k, logit_scale, bias[0], None)
    scale: float = q.shape[-1] ** -0.5  # torchvision's (c // heads) ** -0.5
    return (q * scale).matmul(k.transpose(-2, -1)) + bias


def _output(attn: Any, a: Tensor, v: Tensor) -> Tensor:
    """torchvision's attention dropout, values, projection and dropout: ``(b nw, n, c)``."""
    out = rearrange(F.dropout(a, attn.attention_dropout, attn.training) @ v, "b hd n d -> b n (hd d)")
    return F.dropout(attn.proj(out), attn.dropout, attn.training)


def tv_window_attention(attn: Any, x: Tensor, mask: Tensor | None, labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """torchvision's window attention (v1 or v2) on windows ``(b nw, n, c)``, plus ``mean_h(A_h) @ labels``.

    torchvision builds the matrix explicitly (it has no fused route), so this does too: the
    same operations in the same order, so the logits are torchvision's and the labels mix by
    exactly its weights.

    Args:
        attn: the block's ``ShiftedWindowAttention`` or ``ShiftedWindowAttentionV2``.
        mask: ``(nw, n, m)`` 0/-100 shift mask, or ``None`` (no shift kept).
        labels: ``(b nw, n, l)`` window labels, or ``None`` when this layer is not aligned.
    """
    q, k, v = _qkv(attn, x)
    scores = _scores(attn, q, k)
    if mask is not None:
        scores = rearrange(scores, "(b nw) hd n m -> b nw hd n m", nw=mask.shape[0]) + rearrange(mask, "nw n m -> 1 nw 1 n m")
        scores = rearrange(scores, "b nw hd n m -> (b nw) hd n m")
    a = F.softmax(scores, dim=-1)
    mixed = explicit_mix(a, labels) if labels is not None else None  # the undropped attention
    return _output(attn, a, v), mixed


def _depth(m: Any) -> int:
    return sum(len(unit) for unit in list(m.features)[1:] if not isinstance(unit, _MERGES))


class AdaptedTvSwin(AdaptedBase):
    """A torchvision Swin (v1 or v2) whose forward also returns the scheme's aligned targets (pooled readout)."""

    family = TV_SWIN_FAMILY
    refusal = staticmethod(tv_swin_refusal)

    def _patch(self) -> tuple[int, int]:
        m: Any = self.model
        stride = m.features[0][0].stride
        return int(stride[0]), int(stride[1])

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The reference's labels start on the patch grid (see ``AdaptedBase.reference_bytes``)."""
        return stride_grid(label_map, self._patch())

    def _tokens(self, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int]]:
        """The stem's tokens ``(b, h, w, c)`` (MixToken mixes them) and their grid, once the input is known to tile."""
        m: Any = self.model
        patch = self._patch()
        grid = check_batch(images, label_map, patch)
        _check_grids(m, grid, (int(images.shape[2]), int(images.shape[3])), patch)
        x = m.features[0](images)  # b h w c
        return (mix_token_space(x, label_map, channels_last=True) if label_map.token_space else x), grid

    def _head(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """The logits, and (token-labelling schemes) the head on every final token ``(b, h*w, classes)``."""
        m: Any = self.model
        x = m.norm(x)  # b h w c
        output = m.head(m.flatten(m.avgpool(m.permute(x))))
        token_logits = m.head(rearrange(x, "b h w c -> b (h w) c")) if self.scheme.needs_token_logits else None
        return output, token_logits

    # ------------------------------------------------------------------ fast path
    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid = self._tokens(images, label_map)
        tracker = self.scheme.start(label_map, TokenLayout(grid=grid, num_prefix=0, depth=_depth(m), class_token=False))
        layer = 0
        for unit in list(m.features)[1:]:
            if isinstance(unit, _MERGES):  # concatenating 2x2 tokens: their labels add up
                merge, grid = mean_pool_merge(grid, (2, 2), (2, 2))
                tracker.aggregate(merge, normalised=True)
                x = unit(x)
                continue
            for blk in unit:
                x = through_hooks(blk, functools.partial(self._block, blk, layer=layer, tracker=tracker), x)
                layer += 1
        tracker.pool("mean", 0)
        output, token_logits = self._head(x)
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    # No fsdp_units: the adapted root is sharded, as for the other torchvision families (docs/distributed.md).

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker) -> Tensor:
        """torchvision's block forward (v1 pre-norm, v2 post-norm) with its events and stochastic-depth draws."""
        grid = (int(x.shape[1]), int(x.shape[2]))
        window = (int(blk.attn.window_size[0]), int(blk.attn.window_size[1]))
        shift = kept_shift(grid, window, blk.attn.shift_size)
        mask = shift_mask(grid, window, shift, x) if any(shift) else None
        post = isinstance(blk, SwinTransformerBlockV2)

        def attend(windows: Tensor, labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
            return tv_window_attention(blk.attn, windows, mask, labels)

        out, mixed = shifted_windows(x if post else blk.norm1(x), tracker.labels_for(layer), window, shift, attend)
        out, keep = branch(blk.stochastic_depth, blk.norm1(out) if post else out)
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        out, keep = branch(blk.stochastic_depth, blk.norm2(blk.mlp(x)) if post else blk.mlp(blk.norm2(x)))
        tracker.residual(layer, keep, mixed=None)  # channel mixing (and v2's norm): labels unchanged
        return x + out

    # ------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Windows gathered by token id, each window's explicit attention scattered into one ``(b, n, n)`` matrix per
        block, dense labels. The shift mask is rebuilt from the tokens' positions in the image (a key too far from its
        query along an axis, wrapped round by the shift, is masked), not from torchvision's region slices."""
        m: Any = self.model
        x, grid = self._tokens(images, label_map)
        rules = DenseRules(self.scheme, label_map, grid, 0, _depth(m))
        layer = 0
        for unit in list(m.features)[1:]:
            if isinstance(unit, _MERGES):
                merge, grid = conv_matrix(grid, torch.ones(2, 2), stride=(2, 2))
                rules.aggregate(merge)
                x = unit(x)
                continue
            for blk in unit:
                b, h, w, c = x.shape
                attn, post = blk.attn, isinstance(blk, SwinTransformerBlockV2)
                wh, ww = attn.window_size
                shift = (attn.shift_size[0] if wh < h else 0, attn.shift_size[1] if ww < w else 0)
                ids = window_ids((h, w), (wh, ww), shift)  # nw n: where each shifted window's rows come from
                rows, cols = ids // w, ids % w
                far = ((rows[:, :, None] - rows[:, None, :]).abs() >= wh) | ((cols[:, :, None] - cols[:, None, :]).abs() >= ww)
                inputs = x if post else blk.norm1(x)
                q, k, v = _qkv(attn, rearrange(inputs.flatten(1, 2)[:, ids], "b nw n c -> (b nw) n c"))
                mask = torch.zeros(far.shape, dtype=x.dtype).masked_fill_(far, -100.0)  # nw n m
                a = (_scores(attn, q, k) + repeat(mask, "nw n m -> (b nw) 1 n m", b=b)).softmax(dim=-1)  # (b nw) hd n m
                tokens = x.new_zeros(b, h * w, c)
                tokens[:, ids.flatten()] = rearrange(_output(attn, a, v), "(b nw) n c -> b (nw n) c", b=b)
                tokens = rearrange(tokens, "b (h w) c -> b h w c", h=h)
                attn_out, keep = branch(blk.stochastic_depth, blk.norm1(tokens) if post else tokens)
                mean = rearrange(a.detach().double().mean(dim=1), "(b nw) n m -> b nw n m", b=b)
                rules.mix(layer, window_matrix(mean, ids, h * w), keep)
                x = x + attn_out
                x = x + branch(blk.stochastic_depth, blk.norm2(blk.mlp(x)) if post else blk.mlp(blk.norm2(x)))[0]
                layer += 1
        output, token_logits = self._head(x)
        return rules.result(output, output, "mean", token_logits)


FAMILY = Family(
    name="tv_swin",
    description=TV_SWIN_FAMILY,
    refusal=AdaptedTvSwin.refusal,
    build=AdaptedTvSwin,
    example=tiny(SwinTransformer, patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=[4, 4]),
    timm_modules=(),
    torchvision_builders=BUILDERS,
)
