"""Adapter for timm's DaViT: spatial window attention, channel attention, convolutional position encodings.

Every ``SpatialBlock`` and every ``ChannelBlock`` is one ``layer`` (counted over all stages,
spatial and channel blocks alike). Events per block:

- ``cpe1``, ``cpe2`` (``x + act(dwconv(x))``, no stochastic depth): ``residual(layer, None,
  mixed=Norm(T(K)) Y)``, the depthwise kernel's channel-averaged normalised ``|K|`` on the grid
  with its zero padding, rows renormalised over in-grid taps (``_convnet.apply_path``; the GELU
  is elementwise);
- spatial block: window attention (no shift, no bias) ``residual(layer, keep, mixed=mean_h(A_h) Y)``
  inside every window;
- channel block: channel attention mixes the channels of each token (its weights are
  computed from all tokens, but every token's output reads only its own channels):
  a channel op, ``residual(layer, keep, mixed=None)``;
- MLP: ``residual(layer, keep, mixed=None)``;
- stem (7x7, stride 4, padding 3): the labels start on the pixels and are summed over every
  stem window; each stage's downsampling convolution: ``aggregate`` summing the labels under
  its window (the norms before it are channel ops);
- readout: ``pool("mean", 0)`` (no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` tokens, ``l`` label channels, ``hd`` heads.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.classifier import ClassifierHead, NormMlpClassifierHead
from timm.models.davit import (
    ChannelAttention,
    ChannelAttentionV2,
    ChannelBlock,
    ConvPosEnc,
    DaVit,
    DaVitStage,
    Downsample,
    SpatialBlock,
    WindowAttention,
)
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap
from mixlabels.backbones._attention import attention_with_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import (
    AdaptedBase,
    branch,
    check_static_conv,
    conv_aggregate,
    explicit_mix,
    mix_token_space,
    start_on_stem,
)
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise, window_matrix
from mixlabels.backbones.families.swin import shifted_windows, window_ids
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._convnet import Kernels, residual_labels
from mixlabels.backbones._fsdp import is_sharded, through_hooks

__all__ = ["AdaptedDaViT", "DAVIT_FAMILY"]

DAVIT_FAMILY = (
    "timm DaViT (spatial window attention, channel attention v1/v2 as a channel op, depthwise conv position "
    "encodings as spatial mixes, 7x7 stride-4 stem and strided downsampling convs as aggregation, global average "
    "pooling; every stage's grid divisible by its window; stochastic depth)"
)


def _blocks(stage: Any) -> list[Any]:
    """A stage's spatial and channel blocks in order (timm nests them in one Sequential per depth step)."""
    return [blk for pair in stage.blocks for blk in pair]


def _davit_refusal(model: nn.Module) -> str | None:
    if type(model) is not DaVit:
        return f"{type(model).__name__} is not a timm DaVit"
    m: Any = model
    if not isinstance(m.head, (NormMlpClassifierHead, ClassifierHead)) or m.head.global_pool.pool_type != "avg":
        return "only global average pooling ('avg') has a label readout"
    why = check_static_conv(m.stem.conv, "the stem conv")
    if why is not None:
        return why
    for i, stage in enumerate(m.stages):
        if type(stage) is not DaVitStage:
            return f"stage {i} is {type(stage).__name__}, not timm's DaVitStage"
        if not isinstance(stage.downsample, (Downsample, nn.Identity)):
            return f"stage {i} downsamples with {type(stage.downsample).__name__}, not DaViT's Downsample"
        if isinstance(stage.downsample, Downsample):
            why = check_static_conv(stage.downsample.conv, f"stage {i}'s downsampling conv")
            if why is not None:
                return why
        for j, blk in enumerate(_blocks(stage)):
            where = f"stage {i} block {j}"
            if type(blk) is SpatialBlock:
                if type(blk.attn) is not WindowAttention:
                    return f"{where}'s attention is {type(blk.attn).__name__}, not DaViT's WindowAttention"
            elif type(blk) is ChannelBlock:
                if type(blk.attn) not in (ChannelAttention, ChannelAttentionV2):
                    return f"{where}'s attention is {type(blk.attn).__name__}, not DaViT's channel attention"
            else:
                return f"{where} is {type(blk).__name__}; only DaViT's SpatialBlock and ChannelBlock are supported"
            for name in ("cpe1", "cpe2"):
                cpe = getattr(blk, name)
                if type(cpe) is not ConvPosEnc:
                    return f"{where}'s {name} is {type(cpe).__name__}, not DaViT's ConvPosEnc"
                why = check_static_conv(cpe.proj, f"{where}'s {name}", depthwise=True)
                if why is not None:
                    return why
    return None


def _check_grids(m: Any, grid: tuple[int, int]) -> None:
    """Refuse grids timm would pad (downsampling with an even kernel, windows): padded tokens carry no label."""
    h, w = grid
    for i, stage in enumerate(m.stages):
        if isinstance(stage.downsample, Downsample):
            conv: Any = stage.downsample.conv
            if stage.downsample.even_k and (h % conv.kernel_size[0] or w % conv.kernel_size[1]):
                raise ValueError(
                    f"stage {i} downsamples a {h}x{w} grid with a {conv.kernel_size} kernel and padding; "
                    "use an image size whose grids stay divisible"
                )
            h = (h + 2 * conv.padding[0] - conv.kernel_size[0]) // conv.stride[0] + 1
            w = (w + 2 * conv.padding[1] - conv.kernel_size[1]) // conv.stride[1] + 1
        for blk in _blocks(stage):
            if type(blk) is SpatialBlock and (h % blk.window_size[0] or w % blk.window_size[1]):
                raise ValueError(
                    f"stage {i}'s {h}x{w} grid is not divisible by its {blk.window_size[0]}x{blk.window_size[1]} "
                    "windows: timm would pad with tokens that carry no label; pick an image size (or window size) "
                    "that tiles every stage"
                )


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    """Stem output ``(b, c, h, w)``, its token grid, and the grid the labels start on."""
    grid = check_batch(images, label_map, tuple(m.stem.stride))
    _check_grids(m, grid)
    x = m.stem(images)
    if label_map.token_space:
        return mix_token_space(x, label_map, channels_last=False), grid, grid
    return x, grid, (label_map.image_size[0], label_map.image_size[1])


def _token_logits(m: Any, x: Tensor) -> Tensor:
    """The head's classifier on every final position ``(b, h*w, classes)`` (its norm per position)."""
    head = m.head
    if isinstance(head, NormMlpClassifierHead):
        t = rearrange(head.norm(x), "b c h w -> b (h w) c")  # LayerNorm2d normalises each position
        return head.fc(head.drop(head.pre_logits(t)))  # type: ignore[no-any-return]
    return head.fc(head.drop(rearrange(x, "b c h w -> b (h w) c")))  # type: ignore[no-any-return]


def _cpe_matrix(cpe: Any, grid: tuple[int, int]) -> Tensor:
    """The reference's ``Norm(T(K))`` ``(n, n)`` of a position encoding's depthwise conv, in float64."""
    conv = cpe.proj
    kernel = kernel_reference(conv.weight)
    return row_normalise(conv_matrix(grid, kernel, padding=conv.padding, dilation=conv.dilation)[0])


def _qkv(attn: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = rearrange(attn.qkv(x), "b n (three hd d) -> three b hd n d", three=3, hd=attn.num_heads)
    return q, k, v


def _window_attention(attn: Any, x: Tensor, labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """DaViT's ``WindowAttention.forward`` on windows ``(b nw, n, c)``, plus ``mean_h(A_h) @ labels``."""
    q, k, v = _qkv(attn, x)
    mixed = None
    if not attn.fused_attn:  # timm's explicit path: the matrix exists anyway
        a = attn.softmax((q * attn.scale) @ k.transpose(-2, -1))
        mixed = explicit_mix(a, labels) if labels is not None else None
        out = a @ v
    elif labels is not None:
        out, mixed = attention_with_labels(q, k, v, labels, attn.scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v)
    return attn.proj(rearrange(out, "b hd n d -> b n (hd d)")), mixed


class AdaptedDaViT(AdaptedBase):
    """A timm DaViT whose forward also returns the scheme's aligned targets (pooled readout)."""

    family = DAVIT_FAMILY
    refusal = staticmethod(_davit_refusal)

    # ------------------------------------------------------------------ fast path
    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        depth = sum(len(_blocks(stage)) for stage in m.stages)
        tracker = start_on_stem(self.scheme, label_map, start, grid, depth, m.stem.conv)
        blocks = [blk for stage in m.stages for blk in _blocks(stage)]
        # the ConvPosEnc kernels computed together; under FSDP2's per-block sharding a block's weights are whole only
        # inside its forward, so none is held and each is computed there (``Kernels.label_kernel``)
        kernels = Kernels(() if any(is_sharded(blk) for blk in blocks) else (
            cpe.proj for layer, blk in enumerate(blocks) if tracker.labels_for(layer) is not None for cpe in (blk.cpe1, blk.cpe2)))
        layer = 0
        for stage in m.stages:
            if isinstance(stage.downsample, Downsample):
                grid = conv_aggregate(tracker, grid, stage.downsample.conv)
            x = stage.downsample(x)
            for blk in _blocks(stage):
                x = through_hooks(blk, functools.partial(self._block, blk, layer=layer, tracker=tracker, grid=grid, kernels=kernels), x)
                layer += 1
        x = m.norm_pre(x)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return tuple(blk for stage in m.stages for blk in _blocks(stage))

    def _cpe(self, cpe: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int], kernels: Kernels) -> Tensor:
        labels = tracker.labels_for(layer)
        if labels is not None:  # input-independent kernel: a cheap l-channel conv
            # the kernel read from ``kernels``, expanded with the others of its shape, and its in-grid tap weights
            # computed with theirs (one conv of ones per grid), not a mass conv and an expand per conv; on a GPU's
            # small grids the residual's mean folded into its matrix (``residual_labels``)
            residual_labels(tracker, layer, None, labels, (cpe.proj,), grid, kernels)
        return cpe(x)  # type: ignore[no-any-return]

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int], kernels: Kernels) -> Tensor:
        b, c, h, w = x.shape
        shortcut = rearrange(self._cpe(blk.cpe1, x, layer, tracker, grid, kernels), "b c h w -> b (h w) c")
        cur = blk.norm1(shortcut)
        mixed = None
        if isinstance(blk, SpatialBlock):  # not type(): fully_shard subclasses a sharded block

            def attend(windows: Tensor, labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
                return _window_attention(blk.attn, windows, labels)

            windows = rearrange(cur, "b (h w) c -> b h w c", h=h)
            out, mixed = shifted_windows(windows, tracker.labels_for(layer), tuple(blk.window_size), (0, 0), attend)
            cur = rearrange(out, "b h w c -> b (h w) c")
        else:
            cur = blk.attn(cur)  # channel attention: each token's own channels
        cur, keep = branch(blk.drop_path1, cur)
        tracker.residual(layer, keep, mixed=mixed)
        x = rearrange(shortcut + cur, "b (h w) c -> b c h w", h=h)
        x = self._cpe(blk.cpe2, x, layer, tracker, grid, kernels)
        if blk.mlp is not None:
            t = rearrange(x, "b c h w -> b (h w) c")
            out, keep = branch(blk.drop_path2, blk.mlp(blk.norm2(t)))
            tracker.residual(layer, keep, mixed=None)  # channel mixing
            x = rearrange(t + out, "b (h w) c -> b c h w", h=h)
        return x

    # ------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit convolution, window-attention and merge matrices on dense labels."""
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        depth = sum(len(_blocks(stage)) for stage in m.stages)
        rules = DenseRules(self.scheme, label_map, start, 0, depth)
        if start != grid:
            stem = m.stem.conv
            rules.aggregate(conv_matrix(start, torch.ones(stem.kernel_size), stem.stride, stem.padding)[0])
        layer = 0
        for stage in m.stages:
            if isinstance(stage.downsample, Downsample):
                conv: Any = stage.downsample.conv
                merge, grid = conv_matrix(grid, torch.ones(conv.kernel_size), conv.stride, conv.padding)
                rules.aggregate(merge)
            x = stage.downsample(x)
            for blk in _blocks(stage):
                b, c, h, w = x.shape
                rules.mix(layer, _cpe_matrix(blk.cpe1, grid), None)
                shortcut = blk.cpe1(x).flatten(2).transpose(1, 2)  # b n c
                cur = blk.norm1(shortcut)
                if type(blk) is SpatialBlock:
                    ids = window_ids((h, w), tuple(blk.window_size), (0, 0))  # nw n: the tokens of every window
                    windows = rearrange(cur[:, ids], "b nw n c -> (b nw) n c")
                    q, k, v = _qkv(blk.attn, windows)
                    a = torch.softmax((q * blk.attn.scale) @ k.transpose(-2, -1), dim=-1)  # (b nw) hd n m
                    out = blk.attn.proj(rearrange(a @ v, "b hd n d -> b n (hd d)"))
                    cur = out.new_zeros(b, h * w, c)
                    cur[:, ids.flatten()] = rearrange(out, "(b nw) n c -> b (nw n) c", b=b)
                    cur, keep = branch(blk.drop_path1, cur)
                    mean = rearrange(a.detach().double().mean(dim=1), "(b nw) n m -> b nw n m", b=b)
                    rules.mix(layer, window_matrix(mean, ids, h * w), keep)
                else:  # channel attention: no spatial mix
                    cur = branch(blk.drop_path1, blk.attn(cur))[0]
                x = (shortcut + cur).transpose(1, 2).reshape(b, c, h, w)
                rules.mix(layer, _cpe_matrix(blk.cpe2, grid), None)
                x = blk.cpe2(x)
                if blk.mlp is not None:
                    t = x.flatten(2).transpose(1, 2)
                    t = t + branch(blk.drop_path2, blk.mlp(blk.norm2(t)))[0]
                    x = t.transpose(1, 2).reshape(b, c, h, w)
                layer += 1
        x = m.norm_pre(x)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


FAMILY = Family(
    name="davit",
    description=DAVIT_FAMILY,
    refusal=AdaptedDaViT.refusal,
    build=AdaptedDaViT,
    example=tiny("davit_tiny", depths=(1, 1), embed_dims=(16, 32), num_heads=(2, 2), window_size=4),
    timm_modules=("davit",),
    speed_model="davit_tiny",
)
