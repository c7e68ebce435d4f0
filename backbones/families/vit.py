"""Adapter for timm's VisionTransformer family: runs timm's own modules and emits alignment events.

Shapes: ``b`` batch, ``n`` tokens (prefix + patches), ``p`` prefix tokens, ``h`` heads,
``d`` head dim, ``k`` sources, ``c`` classes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, reduce
from timm.layers.attention import Attention
from timm.layers.patch_embed import PatchEmbed
from timm.models.vision_transformer import (
    Block, DiffParallelScalingBlock, ParallelScalingBlock, ParallelThingsBlock, ResPostBlock, VisionTransformer,
)
from torch import Tensor, nn

from mixlabels.backbones._attention_pool import latent_rows, map_refusal, map_token_targets_refusal
from mixlabels.backbones._attention import attention_with_labels, class_attention, explicit_mix
from mixlabels.backbones._common import AdaptedBase, branch, stride_grid
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._fsdp import through_hooks
from mixlabels.backbones._vit_reference import parallel_scaling_output, reference_forward
from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedViT", "VIT_FAMILY", "attend", "attend_sdpa", "join_branches", "vit_refusal"]

VIT_FAMILY = (
    "timm VisionTransformer (ViT/DeiT with a class token; VisionTransformerDistilled with its distillation "
    "token; register tokens; class_token=False with global_pool='avg'; qk_norm; layer scale (init_values); "
    "stochastic depth (drop_path_rate); attention pooling (global_pool='map': the latent's label is its attention row "
    "over the tokens' labels)) built from timm Block + Attention; also ResPostBlock (post-norm branches), "
    "ParallelThingsBlock (parallel attentions: their labels' mean, then parallel MLPs) and ParallelScalingBlock "
    "(attention and MLP from one norm: Norm(A Y + Y))"
)


def vit_refusal(model: nn.Module, embed: type[nn.Module] = PatchEmbed) -> str | None:
    """Why ``model`` cannot be adapted as a ViT (``None`` if it can); ``embed``: the patch embedding's class
    (``vit_hybrid`` asks with ``HybridEmbed``)."""
    if not isinstance(model, VisionTransformer):
        return f"{type(model).__name__} is not a timm VisionTransformer"
    for i, blk in enumerate(model.blocks):
        why = _block_refusal(blk)
        if why is not None:
            return f"block {i}: {why}"
    if model.global_pool not in ("token", "avg", "map"):
        return f"global_pool={model.global_pool!r} has no label readout; use 'token', 'avg' or 'map'"
    why = map_refusal(model)
    if why is not None:
        return why
    if not isinstance(model.patch_drop, nn.Identity):
        return "patch dropout (patch_drop_rate > 0) drops tokens the labels cannot follow; set patch_drop_rate=0"
    if type(model.patch_embed) is not embed:
        # Hybrid (ResNet stem) and ViTamin (MBConv stages) embeddings: their token grid is not
        # patch_embed.patch_size, so the labels would not follow the tokens.
        return f"patch_embed is {type(model.patch_embed).__name__}, not timm's {embed.__name__} (a conv stem's token grid has no label rule here)"
    if getattr(model.patch_embed, "dynamic_img_pad", False):
        return "dynamic_img_pad pads images, so patches no longer tile the label map; disable it"
    return None


def _block_refusal(blk: nn.Module) -> str | None:
    """Why a block has no label rule here (``None`` if it has)."""
    if type(blk) is ParallelScalingBlock:
        return None
    if type(blk) is DiffParallelScalingBlock:
        return (
            "DiffParallelScalingBlock mixes tokens by differential attention A1 - lambda * A2, whose weights can be "
            "negative: no TL-Align label rule; use ParallelScalingBlock or timm's Attention"
        )
    attns = [sub.attn for sub in blk.attns] if type(blk) is ParallelThingsBlock else [getattr(blk, "attn", None)]
    if type(blk) not in (Block, ResPostBlock, ParallelThingsBlock) or any(type(a) is not Attention for a in attns):
        names = ", ".join(sorted({type(a).__name__ for a in attns}))
        return (
            f"{type(blk).__name__} with {names}; only timm's Block, ResPostBlock or ParallelThingsBlock with its "
            "Attention, or ParallelScalingBlock, is supported (DiffAttention's A1 - lambda * A2 has negative weights: "
            "no label rule)"
        )
    return None


def join_branches(mixes: list[Tensor], keeps: list[Tensor | None]) -> tuple[Tensor, Tensor | None]:
    """The labels of parallel attention branches added to one residual, and the samples that kept any of them.

    The sum of the branches weighs them equally (``_convnet.Parallel.sum``): ``g(Y) = mean_i A_i Y``. Each
    branch draws its own stochastic depth: a branch counts only where it was kept (the ``follow`` rule, written
    into the mixed labels for every scheme, as TNT's per-patch draws); a sample that dropped every branch is the
    residual's ``keep=False`` (the scheme's drop-path rule decides), its mix the mean of all branches.

    Args:
        mixes: each branch's mixed labels ``(b, n, l)``.
        keeps: each branch's kept samples ``(b,)`` bool, or ``None`` (all kept).

    Returns:
        The joined labels ``(b, n, l)`` and the samples that kept any branch ``(b,)`` (``None``: all).
    """
    stacked = torch.stack(mixes)  # r b n l
    if all(k is None for k in keeps):
        return reduce(stacked, "r b n l -> b n l", "mean"), None
    kept = torch.stack([torch.ones(stacked.shape[1], dtype=torch.bool, device=stacked.device) if k is None else k for k in keeps])
    anyone = kept.any(dim=0)  # b
    weights = torch.where(anyone, kept.to(stacked.dtype), 1.0)  # r b
    total = einsum(weights, stacked, "r b, r b n l -> b n l")
    return total / reduce(weights, "r b -> b", "sum")[:, None, None], anyone


def project_qk_v(attn: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k (normed) and v ``(b, h, n, d)`` of timm's ``Attention`` on its input ``x``."""
    q, k, v = rearrange(attn.qkv(x), "b n (three h d) -> three b h n d", three=3, h=attn.num_heads)
    return attn.q_norm(q), attn.k_norm(k), v


class AdaptedViT(AdaptedBase):
    """A timm ViT/DeiT whose forward also returns the scheme's aligned targets.

    ``adapted(images)`` is exactly ``model(images)``. ``adapted(images, label_map)``
    runs the same modules block by block, emits the alignment events, and returns an
    ``AlignedOutput``. Parameters are the model's own (``adapted.model is model``).
    A label map is accepted in eval mode too (targets without stochastic depth).
    """

    family = VIT_FAMILY
    refusal = staticmethod(vit_refusal)

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The reference's labels start on the patch grid (see ``AdaptedBase.reference_bytes``)."""
        m: Any = self.model
        return stride_grid(label_map, tuple(m.patch_embed.patch_size))

    def _grid(self, images: Tensor, label_map: TokenLabelMap) -> tuple[int, int]:
        m: Any = self.model
        return check_batch(images, label_map, tuple(m.patch_embed.patch_size))

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        return tuple(self.model.blocks)  # type: ignore[arg-type]  # timm is untyped

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        self._grid(images, label_map)  # the same input checks as the fast path
        return reference_forward(self.model, self.scheme, images, label_map)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        return self._aligned_forward(images, label_map, self._grid(images, label_map))

    # ------------------------------------------------------------------ fast path
    def _aligned_forward(self, images: Tensor, label_map: TokenLabelMap, grid: tuple[int, int]) -> AlignedOutput:
        m: Any = self.model  # timm is untyped
        x = m.patch_embed(images)  # b n d (or b h w d with dynamic_img_size)
        if label_map.token_space:  # MixToken: mix the patch embeddings, not the pixels
            if x.ndim == 4:
                flat = label_map.mix_tokens(rearrange(x, "b h w d -> b (h w) d"), grid)
                x = rearrange(flat, "b (h w) d -> b h w d", h=grid[0])
            else:
                x = label_map.mix_tokens(x, grid)
        x = m._pos_embed(x)  # b n d, prefix tokens first
        x = m.norm_pre(m.patch_drop(x))
        map_token_targets_refusal(m, self.scheme)
        p = m.num_prefix_tokens
        head_reads_token = m.global_pool == "token"
        layout = TokenLayout(grid=grid, num_prefix=p, depth=len(m.blocks), class_token=head_reads_token)
        tracker = self.scheme.start(label_map, layout)
        for layer, blk in enumerate(m.blocks):
            x = through_hooks(blk, functools.partial(self._block, blk, layer=layer, tracker=tracker), x)
        x = m.norm(x)
        if m.attn_pool is not None:  # the latents' labels: their attention rows over the tokens' labels
            rows = latent_rows(m, x)  # b l n
            tracker.aggregate(lambda y: rows @ y)
            tracker.pool("token" if m.attn_pool.pool == "token" else "mean", 0)
        elif head_reads_token:
            tracker.pool("token", 0)
        else:
            tracker.pool("mean", 0 if m.pool_include_prefix else p)
        output = m.forward_head(x)  # timm's own head: a tensor, or (cls, dist) when training distilled
        logits = output[0] if isinstance(output, tuple) else output
        token_logits = None
        if self.scheme.needs_token_logits:  # LV-ViT: the classifier on every normalised patch token
            token_logits = m.head(m.head_drop(m.fc_norm(x[:, p:])))  # b n c
        t = tracker.finish()
        return AlignedOutput(output, logits, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker) -> Tensor:
        if isinstance(blk, ParallelScalingBlock):
            return self._parallel_scaling(blk, x, layer, tracker)
        if isinstance(blk, ParallelThingsBlock):
            return self._parallel_things(blk, x, layer, tracker)
        post = isinstance(blk, ResPostBlock)  # x + norm(f(x)): the norms are per token, channel ops
        out, mixed = self._attention(blk.attn, x if post else blk.norm1(x), layer, tracker)
        out, keep = branch(blk.drop_path1, blk.norm1(out) if post else blk.ls1(out))
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        out, keep = branch(blk.drop_path2, blk.norm2(blk.mlp(x)) if post else blk.ls2(blk.mlp(blk.norm2(x))))
        tracker.residual(layer, keep, mixed=None)  # channel mixing: labels unchanged
        return x + out

    def _parallel_things(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker) -> Tensor:
        """Parallel attentions on one input, summed into one residual (their labels: ``join_branches``); then
        parallel MLPs (channel mixing). TransMix reads the mean of the branches' class rows."""
        outs, mixes, keeps, rows = [], [], [], []
        for sub in blk.attns:  # timm's order: each branch's attention, layer scale, then its drop-path draw
            h = sub.norm(x)
            out, mixed = self._attention(sub.attn, h, layer, tracker, class_row=False)
            if tracker.wants_class_attention(layer):
                q, k, _ = project_qk_v(sub.attn, h)
                rows.append(class_attention(q, k, sub.attn.scale))
            out, keep = branch(sub.drop_path, sub.ls(out))
            outs.append(out)
            keeps.append(keep)
            if mixed is not None:
                mixes.append(mixed)
        if rows:
            tracker.class_attention(layer, reduce(torch.stack(rows), "r b n -> b n", "mean"))
        mixed, keep = join_branches(mixes, keeps) if mixes else (None, None)
        tracker.residual(layer, keep, mixed=mixed)
        x = x + torch.stack(outs).sum(dim=0)
        x = x + torch.stack([branch(f.drop_path, f.ls(f.mlp(f.norm(x))))[0] for f in blk.ffns]).sum(dim=0)
        return x  # the MLPs mix channels: labels unchanged

    def _parallel_scaling(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker) -> Tensor:
        """Attention and MLP from one norm, summed into one residual: the MLP keeps the labels and a sum weighs
        its branches equally (``_convnet.Parallel.sum``), so ``g(Y) = Norm(A Y + Y) = (A Y + Y) / 2``."""
        mlp_in, q, k, v = torch.split(blk.in_proj(blk.in_norm(x)), blk.in_split, dim=-1)
        if blk.mlp_bias is not None:
            mlp_in = mlp_in + blk.mlp_bias
        q = blk.q_norm(rearrange(q, "b n (h d) -> b h n d", h=blk.num_heads))
        k = blk.k_norm(rearrange(k, "b n (h d) -> b h n d", h=blk.num_heads))
        v = rearrange(v, "b n (h d) -> b h n d", h=blk.num_heads)
        labels = tracker.labels_for(layer)
        heads, mixed = attend(blk, q, k, v, layer, tracker)  # the block holds scale, fused_attn and attn_drop
        out, keep = branch(blk.drop_path, blk.ls(parallel_scaling_output(blk, heads, mlp_in)))
        tracker.residual(layer, keep, mixed=None if mixed is None or labels is None else (mixed + labels) / 2)
        return x + out

    def _attention(
        self, attn: Any, x: Tensor, layer: int, tracker: LabelTracker, class_row: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """The attention branch's output and, when the scheme aligns ``layer``, its mixed labels ``(b, n, l)``."""
        gate = attn.gate(x).sigmoid() if getattr(attn, "gate", None) is not None else None
        q, k, v = project_qk_v(attn, x)
        out, mixed = attend(attn, q, k, v, layer, tracker, class_row=class_row)
        out = rearrange(out, "b h n d -> b n (h d)")
        out = attn.norm(out) if hasattr(attn, "norm") else out
        if gate is not None:
            out = out * gate
        return attn.proj_drop(attn.proj(out)), mixed


def attend(
    attn: Any, q: Tensor, k: Tensor, v: Tensor, layer: int, tracker: LabelTracker, bias: Tensor | None = None,
    class_row: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Self-attention of a timm attention module (``scale``, ``attn_drop``, ``fused_attn``) with its events.

    Args:
        q, k, v: ``(b, h, n, d)``, after any q/k norm or rotary embedding (the mixing weights are
            the attention rows whatever made q and k).
        bias: an additive bias broadcastable to ``(b, h, n, n)`` (a relative position bias), or ``None``.
        class_row: report the class token's row where TransMix reads it (``False``: the caller reports it, as
            parallel branches report their mean).

    Returns:
        The output ``(b, h, n, d)`` as timm computes it (its explicit path when ``fused_attn`` is off)
        and, when the scheme aligns ``layer``, the mixed labels ``(b, n, l)``.
    """
    if attn.fused_attn:
        dropout_p = attn.attn_drop.p if attn.training else 0.0
        return attend_sdpa(q, k, v, attn.scale, dropout_p, layer, tracker, bias, class_row=class_row)
    if class_row and tracker.wants_class_attention(layer):
        tracker.class_attention(layer, class_attention(q, k, attn.scale, bias=bias))  # b n, from q_cls only
    labels, mixed = tracker.labels_for(layer), None
    # timm's explicit path, kept for bit-exact parity; the matrix exists anyway here.
    scores = (q * attn.scale) @ k.transpose(-2, -1)  # b h n n
    a = (scores if bias is None else scores + bias).softmax(dim=-1)
    if labels is not None:
        mixed = explicit_mix(a, labels)
    return attn.attn_drop(a) @ v, mixed


def attend_sdpa(
    q: Tensor, k: Tensor, v: Tensor, scale: float, dropout_p: float, layer: int, tracker: LabelTracker,
    bias: Tensor | None = None, class_row: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Self-attention by ``scaled_dot_product_attention`` with its events (timm's fused ``Attention``, and
    ``nn.MultiheadAttention`` as torchvision's ViT calls it: ``backbones.families.tv_vit``).

    Args:
        q, k, v: ``(b, h, n, d)``.
        scale: the attention's scale for the class row and the labels; the unlabelled call uses SDPA's
            default ``1/sqrt(d)``, as timm's ``Attention`` and ``nn.MultiheadAttention`` call it.
        dropout_p: attention dropout (0 in eval mode).
        bias: an additive bias broadcastable to ``(b, h, n, n)``, or ``None``.
        class_row: report the class token's row where TransMix reads it (``False``: the caller does).

    Returns:
        The output ``(b, h, n, d)`` and, when the scheme aligns ``layer``, the mixed labels ``(b, n, l)``.
    """
    if class_row and tracker.wants_class_attention(layer):
        tracker.class_attention(layer, class_attention(q, k, scale, bias=bias))  # b n, from q_cls only
    labels = tracker.labels_for(layer)
    if labels is not None:
        return attention_with_labels(q, k, v, labels, scale, dropout_p, attn_mask=bias)  # mixed: b n l
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p), None


FAMILY = Family(
    name="vit",
    description=VIT_FAMILY,
    refusal=vit_refusal,
    build=AdaptedViT,
    example=tiny("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
    timm_modules=("vision_transformer", "deit"),
    speed_model="deit_tiny_patch16_224",
    class_token=True,
)
