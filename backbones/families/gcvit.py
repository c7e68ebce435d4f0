"""Adapter for timm's GlobalContextVit (GCViT): local and global-query window attention, fused-MBConv convs.

Every ``GlobalContextVitBlock`` is one ``layer`` (counted over all stages). Events:

- window attention, local (q, k, v from the window) or global-query (q from the stage's global
  query map, generated from the whole feature map and shared by every window of an image;
  k, v from the window): either way each window's softmax rows weigh only that window's
  tokens, so ``residual(layer, keep, mixed=mean_h(A_h) Y)`` inside every window, ``A_h``
  including the relative position bias; the global-query generator (``FeatureBlock``) only
  makes queries and carries no labels;
- MLP (and layer scales, norms): ``residual(layer, keep, mixed=None)``;
- the stem (3x3 stride-2 conv, then a ``Downsample2d``) and each stage's ``Downsample2d``:
  strided convs ``aggregate`` (labels summed under each window; the stem's first conv sums
  pixel labels); the fused-MBConv residual inside (``x + conv_pw(SE(act(conv_dw(x))))``):
  the depthwise conv is a spatial mix ``residual(layer, None, mixed=Norm(T(K)) Y)``
  (``_common.conv_mix``), the SE gate and 1x1 convs are channel ops. It belongs to the layer
  of the block that follows it (the stem's to layer 0);
- readout: ``pool("mean", 0)`` (no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``nw`` windows, ``n m`` tokens in a window,
``l`` label channels, ``hd`` heads, ``d`` head dim.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from timm.layers.classifier import ClassifierHead
from timm.layers.pos_embed_rel import RelPosBias
from timm.models.gcvit import (
    Downsample2d,
    FeatureBlock,
    GlobalContextVit,
    GlobalContextVitBlock,
    GlobalContextVitStage,
    MbConvBlock,
    WindowAttentionGlobal,
)
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._attention import attention_with_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import (
    AdaptedBase,
    branch,
    check_static_conv,
    conv_aggregate,
    conv_label_kernel,
    conv_mix,
    explicit_mix,
    mix_token_space,
    conv_windows,
    start_on_windows,
)
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise, window_matrix
from mixlabels.backbones.families.swin import shifted_windows, window_ids
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks

__all__ = ["AdaptedGCViT", "GCVIT_FAMILY"]

GCVIT_FAMILY = (
    "timm GlobalContextVit / GCViT (local and global-query window attention with relative position bias, "
    "fused-MBConv depthwise convs as spatial mixes, SE and 1x1 convs as channel ops, strided stem and "
    "downsampling convs as aggregation, global average pooling; every stage's grid divisible by its window; "
    "stochastic depth)"
)


def _downsample_refusal(down: Any, where: str) -> str | None:
    if type(down) is not Downsample2d:
        return f"{where} is {type(down).__name__}, not GCViT's Downsample2d"
    if type(down.conv_block) is not MbConvBlock:
        return f"{where}'s conv block is {type(down.conv_block).__name__}, not GCViT's MbConvBlock"
    why = check_static_conv(down.conv_block.conv_dw, f"{where}'s MBConv conv_dw", depthwise=True)
    if why is not None:
        return why
    if type(down.reduction) is not nn.Conv2d:
        return (f"{where} reduces with {type(down.reduction).__name__}; only the strided conv reduction "
                "('conv', timm's default) is supported")
    return check_static_conv(down.reduction, f"{where}'s reduction conv")


def _gcvit_refusal(model: nn.Module) -> str | None:
    if type(model) is not GlobalContextVit:
        return f"{type(model).__name__} is not a timm GlobalContextVit"
    m: Any = model
    if not isinstance(m.head, ClassifierHead) or m.head.global_pool.pool_type != "avg":
        return "only global average pooling ('avg') has a label readout"
    why = check_static_conv(m.stem.conv1, "the stem conv")
    if why is None:
        why = _downsample_refusal(m.stem.down, "the stem's downsampling")
    if why is not None:
        return why
    for i, stage in enumerate(m.stages):
        if type(stage) is not GlobalContextVitStage:
            return f"stage {i} is {type(stage).__name__}, not timm's GlobalContextVitStage"
        if not isinstance(stage.downsample, nn.Identity):
            why = _downsample_refusal(stage.downsample, f"stage {i}'s downsampling")
            if why is not None:
                return why
        if type(stage.global_block) is not FeatureBlock:
            return f"stage {i}'s global query generator is {type(stage.global_block).__name__}, not GCViT's FeatureBlock"
        for j, blk in enumerate(stage.blocks):
            if type(blk) is not GlobalContextVitBlock or type(blk.attn) is not WindowAttentionGlobal:
                return f"stage {i} block {j} is {type(blk).__name__}; only timm's GlobalContextVitBlock is supported"
            if type(blk.attn.rel_pos) is not RelPosBias:
                return f"stage {i} block {j}'s position bias is {type(blk.attn.rel_pos).__name__}, not RelPosBias"
    return None


def _check_grids(m: Any, grid: tuple[int, int]) -> None:
    """Refuse grids the windows would not tile (timm fails there, less clearly)."""
    h, w = grid
    for i, stage in enumerate(m.stages):
        if not isinstance(stage.downsample, nn.Identity):
            h, w = (h + 1) // 2, (w + 1) // 2  # 3x3, stride 2, padding 1
        for blk in stage.blocks:
            wh, ww = blk.window_size
            if h % wh or w % ww:
                raise ValueError(
                    f"stage {i}'s {h}x{w} grid is not divisible by its {wh}x{ww} windows; pick the image size the "
                    "model was built for (img_size), or a window size that tiles every stage"
                )


def _qkv(attn: Any, x: Tensor, q_global: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v ``(b nw, hd, n, d)``: the global query map ``(b, wh, ww, c)`` is every window's query
    where the block uses it (as timm: one query map per image, repeated over its windows)."""
    if attn.use_global:
        k, v = rearrange(attn.qkv(x), "b n (two hd d) -> two b hd n d", two=2, hd=attn.num_heads)
        q = rearrange(q_global, "b wh ww (hd d) -> b hd (wh ww) d", hd=attn.num_heads)
        q = repeat(q, "b hd n d -> (b nw) hd n d", nw=x.shape[0] // q_global.shape[0])
        return q, k, v
    q, k, v = rearrange(attn.qkv(x), "b n (three hd d) -> three b hd n d", three=3, hd=attn.num_heads)
    return q, k, v


def _window_attention(attn: Any, x: Tensor, q_global: Tensor, labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """timm's ``WindowAttentionGlobal.forward`` on windows ``(b nw, n, c)``, plus ``mean_h(A_h) @ labels``."""
    q, k, v = _qkv(attn, x, q_global)
    bias = attn.rel_pos.get_bias()  # 1 hd n n
    mixed = None
    dropping = attn.training and attn.attn_drop.p > 0
    if dropping or (torch.is_grad_enabled() and bias.requires_grad):
        # timm's dropout draw on the matrix; or a learnable bias, whose gradient no fused kernel
        # returns (SDPA would build the matrix anyway): timm's explicit order
        a = ((q * attn.scale) @ k.transpose(-2, -1) + bias).softmax(dim=-1)
        mixed = explicit_mix(a, labels) if labels is not None else None
        out = attn.attn_drop(a) @ v
    elif labels is not None:
        out, mixed = attention_with_labels(q, k, v, labels, attn.scale, 0.0, attn_mask=bias)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=attn.scale)
    return attn.proj_drop(attn.proj(rearrange(out, "b hd n d -> b n (hd d)"))), mixed


def _global_query(stage: Any, x: Tensor) -> Tensor:
    """The stage's global query map ``(b, wh, ww, c)`` from the whole NCHW feature map, as timm makes it."""
    q: Tensor = stage.global_norm(rearrange(stage.global_block(x), "b c h w -> b h w c"))
    for blk in stage.blocks:
        if blk.attn.use_global and tuple(q.shape[1:3]) != tuple(blk.window_size):
            raise ValueError(
                f"the global query map is {q.shape[1]}x{q.shape[2]} for {blk.window_size[0]}x{blk.window_size[1]} "
                f"windows: its pooling levels were fixed for another image size; use the model's img_size"
            )
    return q


def _dw_matrix(conv: Any, grid: tuple[int, int]) -> Tensor:
    """The reference's ``Norm(T(K))`` ``(n, n)`` of a depthwise conv, in float64."""
    kernel = kernel_reference(conv.weight)
    return row_normalise(conv_matrix(grid, kernel, padding=conv.padding, dilation=conv.dilation)[0])


class AdaptedGCViT(AdaptedBase):
    """A timm GCViT whose forward also returns the scheme's aligned targets (pooled readout)."""

    family = GCVIT_FAMILY
    refusal = staticmethod(_gcvit_refusal)

    def _start(self, images: Tensor, label_map: TokenLabelMap) -> tuple[tuple[int, int], tuple[int, int], int]:
        """The token grid after the stem, the grid the labels start on, and the number of layers."""
        m: Any = self.model
        grid = check_batch(images, label_map, (4, 4))  # the stem: two stride-2 convs
        _check_grids(m, grid)
        start = grid if label_map.token_space else (label_map.image_size[0], label_map.image_size[1])
        return grid, start, sum(len(stage.blocks) for stage in m.stages)

    # ------------------------------------------------------------------ fast path
    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        grid, start, depth = self._start(images, label_map)
        x = m.stem.conv1(images)
        if label_map.token_space:  # labels start on the stem's output: its convs have nothing to move
            tracker = self.scheme.start(label_map, TokenLayout(grid=start, num_prefix=0, depth=depth, class_token=False))
            x = mix_token_space(m.stem.down(x), label_map, channels_last=False)
        else:  # the pixels under conv1's windows, then the stem's Downsample2d
            tracker, half = start_on_windows(self.scheme, label_map, start, depth, [conv_windows(m.stem.conv1)])
            x = self._downsample(m.stem.down, x, 0, tracker, half)
        layer = 0
        for stage in m.stages:
            if not isinstance(stage.downsample, nn.Identity):
                x = self._downsample(stage.downsample, x, layer, tracker, grid)
                grid = (int(x.shape[2]), int(x.shape[3]))
            q_global = _global_query(stage, x)
            x = rearrange(x, "b c h w -> b h w c")
            for blk in stage.blocks:
                x = through_hooks(blk, functools.partial(self._block, blk, layer=layer, tracker=tracker), x, q_global)
                layer += 1
            x = rearrange(stage.norm(x), "b h w c -> b c h w")
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = None
        if self.scheme.needs_token_logits:  # the classifier on every final position
            token_logits = m.head.fc(m.head.drop(rearrange(x, "b c h w -> b (h w) c")))
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return tuple(blk for stage in m.stages for blk in stage.blocks)  # the global query and downsampling: the root's

    def _downsample(self, down: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int]) -> Tensor:
        """``Downsample2d``: norm, fused-MBConv residual (its depthwise conv mixes), strided conv (aggregates), norm."""
        labels = tracker.labels_for(layer)
        if labels is not None:  # input-independent kernel: a cheap l-channel conv
            conv = down.conv_block.conv_dw
            tracker.residual(layer, None, mixed=conv_mix(labels, grid, conv_label_kernel(conv.weight), conv.padding, conv.dilation))
        conv_aggregate(tracker, grid, down.reduction)
        return down(x)  # type: ignore[no-any-return]

    def _block(self, blk: Any, x: Tensor, q_global: Tensor, layer: int, tracker: LabelTracker) -> Tensor:
        def attend(windows: Tensor, labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
            return _window_attention(blk.attn, windows, q_global, labels)

        out, mixed = shifted_windows(blk.norm1(x), tracker.labels_for(layer), tuple(blk.window_size), (0, 0), attend)
        out, keep = branch(blk.drop_path1, blk.ls1(out))
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        out, keep = branch(blk.drop_path2, blk.ls2(blk.mlp(blk.norm2(x))))
        tracker.residual(layer, keep, mixed=None)  # channel mixing
        return x + out

    # ------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit convolution, window-attention and merge matrices on dense labels."""
        m: Any = self.model
        grid, start, depth = self._start(images, label_map)
        rules = DenseRules(self.scheme, label_map, start, 0, depth)

        def downsample(down: Any, x: Tensor, layer: int, grid: tuple[int, int]) -> Tensor:
            rules.mix(layer, _dw_matrix(down.conv_block.conv_dw, grid), None)
            conv = down.reduction
            rules.aggregate(conv_matrix(grid, torch.ones(conv.kernel_size), conv.stride, conv.padding)[0])
            return down(x)  # type: ignore[no-any-return]

        x = m.stem.conv1(images)
        if label_map.token_space:
            x = mix_token_space(m.stem.down(x), label_map, channels_last=False)
        else:
            conv = m.stem.conv1
            merge, mid = conv_matrix(start, torch.ones(conv.kernel_size), conv.stride, conv.padding)
            rules.aggregate(merge)
            x = downsample(m.stem.down, x, 0, mid)
        layer = 0
        for stage in m.stages:
            if not isinstance(stage.downsample, nn.Identity):
                x = downsample(stage.downsample, x, layer, grid)
                grid = (int(x.shape[2]), int(x.shape[3]))
            q_global = _global_query(stage, x)
            x = x.permute(0, 2, 3, 1)
            for blk in stage.blocks:
                b, h, w, c = x.shape
                attn = blk.attn
                ids = window_ids((h, w), tuple(blk.window_size), (0, 0))  # nw n: the tokens of every window
                windows = rearrange(blk.norm1(x).flatten(1, 2)[:, ids], "b nw n c -> (b nw) n c")
                q, k, v = _qkv(attn, windows, q_global)
                a = torch.softmax((q * attn.scale) @ k.transpose(-2, -1) + attn.rel_pos.get_bias(), dim=-1)
                out = attn.proj_drop(attn.proj(rearrange(attn.attn_drop(a) @ v, "b hd n d -> b n (hd d)")))
                tokens = out.new_zeros(b, h * w, c)
                tokens[:, ids.flatten()] = rearrange(out, "(b nw) n c -> b (nw n) c", b=b)
                out, keep = branch(blk.drop_path1, blk.ls1(tokens.view(b, h, w, c)))
                mean = rearrange(a.detach().double().mean(dim=1), "(b nw) n m -> b nw n m", b=b)
                rules.mix(layer, window_matrix(mean, ids, h * w), keep)
                x = x + out
                x = x + branch(blk.drop_path2, blk.ls2(blk.mlp(blk.norm2(x))))[0]
                layer += 1
            x = stage.norm(x).permute(0, 3, 1, 2)
        output = m.forward_head(x)
        token_logits = m.head.fc(m.head.drop(x.flatten(2).transpose(1, 2))) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


FAMILY = Family(
    name="gcvit",
    description=GCVIT_FAMILY,
    refusal=AdaptedGCViT.refusal,
    build=AdaptedGCViT,
    example=tiny(GlobalContextVit, img_size=32, window_size=4, embed_dim=16, depths=(1, 2), num_heads=(2, 2)),
    timm_modules=("gcvit",),
    speed_model="gcvit_xxtiny",
)
