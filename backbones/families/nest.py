"""Adapter for timm's Nest (Nested Transformer): block-local attention, then ConvPool aggregation between levels.

TL-Align Table 10 and Appendix D extended as for Swin and MetaFormer. Events:

- patch embedding (kernel == stride): labels start as the exact area fractions of the patches.
- every ``TransformerLayer`` (one ``layer``): attention inside each non-overlapping block of
  the level's grid (``blockify``): ``residual(layer, keep, mixed=mean_h(A_h) Y)`` with the
  labels blockified exactly as the tokens; the MLP: ``residual(layer, keep, mixed=None)``. The
  level's position embedding is added per token: a channel op.
- ``ConvPool`` between levels (no residual: its output replaces the tokens), two ``aggregate``
  events: the 3x3 stride-1 conv is a spatial mix of the whole grid; a full conv has one kernel
  per (output, input) channel pair, and each pair's normalised ``|K|`` is a distribution over
  the taps, as each depthwise channel's is, so the rule is ``conv_mix``'s with the average over
  all pairs, ``Norm(T(mean_oi |K_oi| / sum |K_oi|)) Y`` (border-renormalised); the 3x3/2 max pool
  then sums the labels over each window (a max picks one tap per channel and token, different
  taps in different channels: the window as a whole is what the token draws on). TF ``'same'``
  padding (the ``nest_*_jx`` models) pads the pool by its input size, one row and column after;
  the window sums follow that padding exactly. The LayerNorm between is a channel op.
- readout: ``pool("mean", 0)`` (global average pooling; no class token: TransMix refuses).

Shapes: ``b`` batch, ``t`` blocks, ``n`` tokens in a block, ``c`` channels, ``l`` label channels,
``gh gw`` blocks along each side, ``bh bw`` a block's side.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.padding import pad_same_arg
from timm.layers.pool2d_same import MaxPool2dSame
from timm.models.nest import Attention, ConvPool, Nest, NestLevel, TransformerLayer
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._attention import attention_with_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, check_static_conv, conv_label_kernel, conv_mix, explicit_mix, mix_token_space, pool_labels, stride_grid
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise, window_matrix
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks

__all__ = ["AdaptedNest", "NEST_FAMILY"]

NEST_FAMILY = (
    "timm Nest (block-local attention on blockified grids; ConvPool between levels: its 3x3 conv as a "
    "channel-pair-averaged normalised-absolute-kernel spatial mix, its 3x3/2 max pool as window aggregation, "
    "static or TF 'same' padding; position embeddings and norms as channel ops; global average pooling; "
    "stochastic depth)"
)

BLOCKS = "b (gh bh) (gw bw) c -> b (gh gw) (bh bw) c"  # timm's blockify


def _nest_refusal(model: nn.Module) -> str | None:
    if type(model) is not Nest:
        return f"{type(model).__name__} is not a timm Nest"
    m: Any = model
    if m.global_pool.pool_type != "avg":
        return f"global_pool={m.global_pool.pool_type!r} has no label readout; use 'avg'"
    pe = m.patch_embed.proj
    why = check_static_conv(pe, "the patch embedding")
    if why is None and (pe.kernel_size != pe.stride or pe.padding != (0, 0)):
        why = "the patch embedding overlaps (kernel != stride); only patch tokens are supported"
    if why is not None:
        return why
    for i, level in enumerate(m.levels):
        if type(level) is not NestLevel:
            return f"level {i} is {type(level).__name__}, not timm's NestLevel"
        if isinstance(level.pool, ConvPool):
            why = check_static_conv(level.pool.conv, f"level {i}'s ConvPool conv")
            if why is None and level.pool.conv.stride != (1, 1):
                why = f"level {i}'s ConvPool conv is strided"
            pool = level.pool.pool
            if why is None and (type(pool) not in (nn.MaxPool2d, MaxPool2dSame) or pool.ceil_mode or _pair(pool.dilation) != (1, 1)):
                why = f"level {i}'s ConvPool pool is {type(pool).__name__}; only a MaxPool2d (static or 'same') is supported"
            if why is not None:
                return why
        elif not isinstance(level.pool, nn.Identity):
            return f"level {i} pools with {type(level.pool).__name__}, not ConvPool"
        for j, layer in enumerate(level.transformer_encoder):
            if type(layer) is not TransformerLayer or type(layer.attn) is not Attention:
                return f"level {i} layer {j} is {type(layer).__name__}; only timm's Nest TransformerLayer is supported"
    return None


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _pool_padding(pool: Any, grid: tuple[int, int]) -> tuple[int, int, int, int]:
    """``(left, right, top, bottom)`` zero padding of the max pool on ``grid`` (static, or TF 'same')."""
    if type(pool) is MaxPool2dSame:
        left, right, top, bottom = pad_same_arg(list(grid), list(_pair(pool.kernel_size)), list(_pair(pool.stride)))
        return int(left), int(right), int(top), int(bottom)
    ph, pw = _pair(pool.padding)
    return pw, pw, ph, ph


def _pool_merge(labels: Tensor, grid: tuple[int, int], pool: Any) -> tuple[Tensor, tuple[int, int]]:
    """Labels summed over every pooling window (padding adds nothing) ``(b, n, l) -> (b, n', l)``."""
    left, right, top, bottom = _pool_padding(pool, grid)
    y = rearrange(labels, "b (h w) l -> b l h w", h=grid[0])
    y = F.pad(y, (left, right, top, bottom))
    padded = (int(y.shape[-2]), int(y.shape[-1]))
    return pool_labels(rearrange(y, "b l h w -> b (h w) l"), padded, _pair(pool.kernel_size), _pair(pool.stride), (0, 0))


def _pool_sums(labels: Tensor, grid: tuple[int, int], pool: Any) -> Tensor:
    return _pool_merge(labels, grid, pool)[0]


def _pool_matrix(grid: tuple[int, int], pool: Any) -> tuple[Tensor, tuple[int, int]]:
    """The explicit 0/1 ``(n', n)`` window matrix of the max pool (the reference)."""
    left, right, top, bottom = _pool_padding(pool, grid)
    padded = (grid[0] + top + bottom, grid[1] + left + right)
    m, out = conv_matrix(padded, torch.ones(_pair(pool.kernel_size)), _pair(pool.stride))
    ys, xs = torch.meshgrid(torch.arange(grid[0]) + top, torch.arange(grid[1]) + left, indexing="ij")
    return m[:, (ys * padded[1] + xs).flatten()], out  # padded columns dropped: padding adds nothing


def _qkv(attn: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v ``(b t, h, n, d)`` from timm's ``(b, t, n, 3 h d)`` layout."""
    q, k, v = rearrange(attn.qkv(x), "b t n (three h d) -> three (b t) h n d", three=3, h=attn.num_heads)
    return q, k, v


def _attn_out(attn: Any, out: Tensor, b: int) -> Tensor:
    # timm permutes (b, h, t, n, d) to (b, t, n, d, h): channels ordered (d h), not (h d)
    return attn.proj_drop(attn.proj(rearrange(out, "(b t) h n d -> b t n (d h)", b=b)))  # type: ignore[no-any-return]


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int]]:
    grid = check_batch(images, label_map, _pair(m.patch_embed.proj.stride))
    x = m.patch_embed(images)  # b c h w
    if label_map.token_space:
        x = mix_token_space(x, label_map, channels_last=False)
    return x, grid


def _blockify(level: Any, x: Tensor, grid: tuple[int, int]) -> tuple[Tensor, dict[str, int]]:
    """timm's level entry after its pool: channels last, blockified, position embedding added."""
    bs = level.block_size
    if grid[0] % bs or grid[1] % bs:
        raise ValueError(f"a {grid[0]}x{grid[1]} grid is not divisible by Nest's {bs}x{bs} blocks; use the model's img_size")
    sizes = {"bh": bs, "bw": bs}
    x = rearrange(x, "b c h w -> b h w c")
    return rearrange(x, BLOCKS, **sizes) + level.pos_embed, sizes


def _deblockify(x: Tensor, sizes: dict[str, int], grid: tuple[int, int]) -> Tensor:
    return rearrange(x, "b (gh gw) (bh bw) c -> b c (gh bh) (gw bw)", gh=grid[0] // sizes["bh"], **sizes)


def _heads(m: Any, x: Tensor) -> Tensor:
    """The classifier on every final position (after the final norm): ``(b, h*w, classes)``."""
    return m.head(m.head_drop(rearrange(x, "b c h w -> b (h w) c")))  # type: ignore[no-any-return]


def _check_even(grid: tuple[int, int], i: int) -> None:
    if grid[0] % 2 or grid[1] % 2:
        raise ValueError(f"level {i}'s ConvPool needs an even grid, got {grid}; use the model's img_size")


class AdaptedNest(AdaptedBase):
    """A timm Nest returning the scheme's aligned targets (pooled readout)."""

    family = NEST_FAMILY
    refusal = staticmethod(_nest_refusal)

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The reference's labels start on the patch grid (see ``AdaptedBase.reference_bytes``)."""
        m: Any = self.model
        return stride_grid(label_map, tuple(m.patch_embed.proj.stride))

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid = _embed(m, images, label_map)
        depth = sum(len(level.transformer_encoder) for level in m.levels)
        tracker = self.scheme.start(label_map, TokenLayout(grid=grid, num_prefix=0, depth=depth, class_token=False))
        layer = 0
        for i, level in enumerate(m.levels):
            if isinstance(level.pool, ConvPool):
                _check_even(grid, i)
                conv, pool, g = level.pool.conv, level.pool.pool, grid
                kernel = conv_label_kernel(conv.weight)
                tracker.aggregate(partial(conv_mix, grid=g, kernel=kernel, padding=conv.padding, dilation=conv.dilation))
                tracker.aggregate(partial(_pool_sums, grid=g, pool=pool))
                x = level.pool(x)
                grid = (int(x.shape[2]), int(x.shape[3]))
            h, sizes = _blockify(level, x, grid)
            for blk in level.transformer_encoder:
                h = through_hooks(blk, partial(self._layer, blk, layer=layer, tracker=tracker, grid=grid, sizes=sizes), h)
                layer += 1
            x = _deblockify(h, sizes, grid)
        x = rearrange(m.norm(rearrange(x, "b c h w -> b h w c")), "b h w c -> b c h w")
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _heads(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return tuple(blk for level in m.levels for blk in level.transformer_encoder)  # ConvPool and position embeddings: the root's

    def _layer(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int], sizes: dict[str, int]) -> Tensor:
        attn, labels, mixed = blk.attn, tracker.labels_for(layer), None
        b = x.shape[0]
        q, k, v = _qkv(attn, blk.norm1(x))
        dropout_p = attn.attn_drop.p if attn.training else 0.0
        gh = grid[0] // sizes["bh"]
        one_block = grid == (sizes["bh"], sizes["bw"])  # the grid's row-major order is already the block's: no views
        if labels is not None and not one_block:  # blockified like the tokens: (b t) n l
            labels = rearrange(labels, "b (gh bh gw bw) l -> (b gh gw) (bh bw) l", gh=gh, **sizes)
        if not attn.fused_attn:
            a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # timm's explicit path
            if labels is not None:
                mixed = explicit_mix(a, labels)
            out = attn.attn_drop(a) @ v
        elif labels is not None:
            out, mixed = attention_with_labels(q, k, v, labels, attn.scale, dropout_p)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        if mixed is not None and not one_block:  # back to the grid's row-major order
            mixed = rearrange(mixed, "(b gh gw) (bh bw) l -> b (gh bh gw bw) l", b=b, gh=gh, **sizes)
        out, keep = branch(blk.drop_path1, _attn_out(attn, out, b))
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        out, keep = branch(blk.drop_path2, blk.mlp(blk.norm2(x)))
        tracker.residual(layer, keep, mixed=None)  # channel mixing
        return x + out

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit block attention scattered over the grid, conv and pool matrices, dense labels."""
        m: Any = self.model
        x, grid = _embed(m, images, label_map)
        depth = sum(len(level.transformer_encoder) for level in m.levels)
        rules = DenseRules(self.scheme, label_map, grid, 0, depth)
        layer = 0
        for i, level in enumerate(m.levels):
            if isinstance(level.pool, ConvPool):
                _check_even(grid, i)
                conv = level.pool.conv
                kernel = kernel_reference(conv.weight)
                rules.aggregate(row_normalise(conv_matrix(grid, kernel, padding=conv.padding, dilation=conv.dilation)[0]))
                merge, grid = _pool_matrix(grid, level.pool.pool)
                rules.aggregate(merge)
                x = level.pool(x)
            h, sizes = _blockify(level, x, grid)
            ids = rearrange(torch.arange(grid[0] * grid[1]).view(1, grid[0], grid[1], 1), BLOCKS, **sizes)[0, :, :, 0]  # t n
            for blk in level.transformer_encoder:
                attn = blk.attn
                q, k, v = _qkv(attn, blk.norm1(h))
                a = torch.softmax(q @ k.transpose(-2, -1) * attn.scale, dim=-1)  # (b t) h n n
                out = _attn_out(attn, F.dropout(a, attn.attn_drop.p, attn.training) @ v, h.shape[0])
                out, keep = branch(blk.drop_path1, out)
                mean = rearrange(a.detach().double().mean(dim=1), "(b t) n m -> b t n m", b=h.shape[0])
                rules.mix(layer, window_matrix(mean, ids, grid[0] * grid[1]), keep)
                h = h + out
                h = h + branch(blk.drop_path2, blk.mlp(blk.norm2(h)))[0]
                layer += 1
            x = _deblockify(h, sizes, grid)
        x = rearrange(m.norm(rearrange(x, "b c h w -> b h w c")), "b h w c -> b c h w")
        output = m.forward_head(x)
        token_logits = _heads(m, x) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


FAMILY = Family(
    name="nest",
    description=NEST_FAMILY,
    refusal=AdaptedNest.refusal,
    build=AdaptedNest,
    example=tiny(Nest, img_size=32, patch_size=4, num_levels=3, embed_dims=(8, 16, 32), num_heads=(1, 2, 2), depths=(1, 1, 1),
        drop_path_rate=0.1),
    timm_modules=("nest",),
    speed_model="nest_tiny_jx",
)
