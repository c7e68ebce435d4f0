"""Reference path for the ViT adapter: explicit attention matrices and dense labels.

Written for clarity, not speed, and independently of the event protocol: every
attention is an explicit matrix handed to the core's ``DenseTracker``, which applies
any scheme's rules on dense ``(b, n, c)`` float64 class distributions, so the fast
path (compact ``(b, n, k)`` weights, alignment fused into attention, events) is
tested against a second implementation. Materialises ``(b, h, n, n)`` per layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.models.vision_transformer import ParallelScalingBlock, ParallelThingsBlock, ResPostBlock
from torch import Tensor, nn

from mixlabels.backbones._attention_pool import latent_rows_reference, map_token_targets_refusal
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import branch as through_drop_path
from mixlabels import AlignedOutput, DenseTracker, Scheme, TokenLabelMap, TokenLayout

__all__ = ["parallel_scaling_output", "reference_block", "reference_forward"]


def reference_forward(model: nn.Module, scheme: Scheme, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
    """Run a timm ViT on a mixed batch with explicit attention and dense labels.

    Args:
        model: a timm ``VisionTransformer`` (as accepted by ``backbones.adapt``).
        scheme: any ``Scheme`` (its rules are applied by ``DenseTracker``).
        images: ``(b, 3, H, W)``.
        label_map: the batch's map.

    Returns:
        The same ``AlignedOutput`` as the fast path (``weights`` is ``None``: labels are dense).
    """
    m: Any = model  # timm is untyped
    grid = check_batch(images, label_map, tuple(m.patch_embed.patch_size))
    map_token_targets_refusal(m, scheme)
    depth, p = len(m.blocks), m.num_prefix_tokens
    reads_token = m.global_pool == "token"
    tracker = DenseTracker.start(scheme, label_map, TokenLayout(grid=grid, num_prefix=p, depth=depth, class_token=reads_token))

    x = m.patch_embed(images)
    if label_map.token_space:
        if x.ndim == 4:
            x = rearrange(
                label_map.mix_tokens(rearrange(x, "b h w d -> b (h w) d"), grid), "b (h w) d -> b h w d", h=grid[0]
            )
        else:
            x = label_map.mix_tokens(x, grid)
    x = m.norm_pre(m.patch_drop(m._pos_embed(x)))  # b n d

    for i, blk in enumerate(m.blocks):
        x = reference_block(blk, i, x, tracker)
    x = m.norm(x)
    output = m.forward_head(x)
    logits = output[0] if isinstance(output, tuple) else output

    token_logits = m.head(m.head_drop(m.fc_norm(x[:, p:]))) if scheme.needs_token_logits else None
    if m.attn_pool is not None:  # a MAP head: the latents' labels are their attention rows over the tokens'
        tracker.aggregate(latent_rows_reference(m, x))  # b l n
        return tracker.result(output, logits, "token" if m.attn_pool.pool == "token" else "mean", token_logits, first=0)
    if reads_token:
        return tracker.result(output, logits, "token", token_logits)
    return tracker.result(output, logits, "mean", token_logits, first=0 if m.pool_include_prefix else p)


def reference_block(blk: Any, i: int, x: Tensor, tracker: DenseTracker, grid: tuple[int, int] | None = None) -> Tensor:
    """One timm ViT block (``Block``, ``ResPostBlock``, ``ParallelThingsBlock``, ``ParallelScalingBlock``) as layer
    ``i`` by explicit attention matrices on the dense labels; returns its output ``(b, n, c)``.

    ``grid``: the patch grid of the class row where TransMix reads it, when the model changed it (PiT's pooling).
    """
    if isinstance(blk, ParallelScalingBlock):
        return _parallel_scaling(blk, i, x, tracker)
    if isinstance(blk, ParallelThingsBlock):
        return _parallel_things(blk, i, x, tracker)
    post = isinstance(blk, ResPostBlock)  # x + norm(f(x)): the norms are per token
    out, a = _attention(blk.attn, x if post else blk.norm1(x))
    branch, keep = through_drop_path(blk.drop_path1, blk.norm1(out) if post else blk.ls1(out))
    tracker.mix(i, a.detach().double().mean(dim=1), keep)  # Eq. 9: head-mean attention on the labels
    if tracker.wants_class_attention(i):
        tracker.attend_class(a.detach().double()[:, :, 0].mean(dim=1), grid)  # b n: the class token's row
    x = x + branch
    mlp = blk.norm2(blk.mlp(x)) if post else blk.ls2(blk.mlp(blk.norm2(x)))
    return x + through_drop_path(blk.drop_path2, mlp)[0]  # MLP residual: Norm(Y + Y) = Y


def _attention(attn: Any, h: Tensor) -> tuple[Tensor, Tensor]:
    """timm's ``Attention`` on ``h`` by its explicit matrix: the branch output ``(b, n, c)`` and ``A`` ``(b, h, n, n)``."""
    q, k, v = rearrange(attn.qkv(h), "b n (three h d) -> three b h n d", three=3, h=attn.num_heads)
    q, k = attn.q_norm(q), attn.k_norm(k)
    a = torch.softmax(q @ k.transpose(-2, -1) * attn.scale, dim=-1)  # b h n n, the full matrix
    out = F.dropout(a, attn.attn_drop.p, attn.training) @ v  # b h n d
    out = attn.norm(rearrange(out, "b h n d -> b n (h d)"))
    if getattr(attn, "gate", None) is not None:
        out = out * attn.gate(h).sigmoid()
    return attn.proj_drop(attn.proj(out)), a


def _parallel_things(blk: Any, i: int, x: Tensor, tracker: DenseTracker) -> Tensor:
    """Parallel attentions summed into one residual: ``Y <- Norm(Y + mean_i A_i Y)`` over the branches a sample
    kept (all of them where it kept none: then the scheme's drop-path rule decides), then parallel MLPs."""
    outs, matrices, keeps, rows = [], [], [], []
    for sub in blk.attns:
        out, a = _attention(sub.attn, sub.norm(x))
        out, keep = through_drop_path(sub.drop_path, sub.ls(out))
        outs.append(out)
        matrices.append(a.detach().double().mean(dim=1))  # b n n
        keeps.append(keep)
        rows.append(a.detach().double()[:, :, 0].mean(dim=1))  # b n
    kept = torch.stack([torch.ones(x.shape[0], dtype=torch.bool) if k is None else k for k in keeps])  # r b
    kept_any = kept.any(dim=0)  # b
    weights = torch.where(kept_any, kept.double(), 1.0)  # r b
    matrix = torch.einsum("rb,rbnm->bnm", weights, torch.stack(matrices)) / weights.sum(dim=0)[:, None, None]
    tracker.mix(i, matrix, None if all(k is None for k in keeps) else kept_any)
    if tracker.wants_class_attention(i):
        tracker.attend_class(torch.stack(rows).mean(dim=0))  # the branches' class rows, weighed as their sum
    x = x + torch.stack(outs).sum(dim=0)
    return x + torch.stack([through_drop_path(f.drop_path, f.ls(f.mlp(f.norm(x))))[0] for f in blk.ffns]).sum(dim=0)


def _parallel_scaling(blk: Any, i: int, x: Tensor, tracker: DenseTracker) -> Tensor:
    """Attention and MLP from one norm, summed into one residual: ``Y <- Norm(Y + (A Y + Y) / 2)``."""
    mlp_in, q, k, v = torch.split(blk.in_proj(blk.in_norm(x)), blk.in_split, dim=-1)
    if blk.mlp_bias is not None:
        mlp_in = mlp_in + blk.mlp_bias
    q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=blk.num_heads) for t in (q, k, v))
    q, k = blk.q_norm(q), blk.k_norm(k)
    a = torch.softmax(q @ k.transpose(-2, -1) * blk.scale, dim=-1)  # b h n n
    heads = F.dropout(a, blk.attn_drop.p, blk.training) @ v  # b h n d
    branch, keep = through_drop_path(blk.drop_path, blk.ls(parallel_scaling_output(blk, heads, mlp_in)))
    eye = torch.eye(x.shape[1], dtype=torch.float64)
    tracker.mix(i, (a.detach().double().mean(dim=1) + eye) / 2, keep)  # the MLP branch is the identity's half
    if tracker.wants_class_attention(i):
        tracker.attend_class(a.detach().double()[:, :, 0].mean(dim=1))
    return x + branch


def parallel_scaling_output(blk: Any, heads: Tensor, mlp_in: Tensor) -> Tensor:
    """timm's ``ParallelScalingBlock`` output before layer scale: the attention heads ``(b, h, n, d)`` and the
    MLP's hidden ``(b, n, f)`` projected (fused or separately) and summed, as timm does (channel ops only)."""
    attn_out = rearrange(heads, "b h n d -> b n (h d)")
    mlp_out = blk.mlp_drop(blk.mlp_act(mlp_in))
    if blk.out_proj is not None:
        return blk.out_proj(torch.cat((attn_out, mlp_out), dim=-1))  # type: ignore[no-any-return]
    return blk.attn_out_proj(attn_out) + blk.mlp_out_proj(mlp_out)  # type: ignore[no-any-return]
