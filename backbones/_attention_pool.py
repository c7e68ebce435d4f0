"""Labels through timm's attention-pooling head (``global_pool='map'``, ``AttentionPoolLatent``).

A MAP head is a learned latent query (``latent_len`` of them) attending, multi-head, over the
final tokens, then a residual MLP on the latent, then a readout of latent 0 (``pool_type='token'``)
or of their mean (``'avg'``). The latent has no image content of its own (it is a parameter, the
same for every image), and the attention has no residual around it, so the latent's label is its
head-mean attention row over the tokens applied to their labels, as TL-Align's Eq. 9 moves a
class token's label, with nothing of its own to average in; the MLP residual is a channel op.
Events: ``aggregate`` of the tokens into the latents by those rows, then ``pool`` (``"token"`` 0
or ``"mean"`` 0). TransMix and MixPro read a class token's row, which a MAP model's head does not
read: they refuse as for any pooled model. Token labelling would lose its per-patch labels in
the aggregate: refused (``map_token_targets_refusal``).

Shapes: ``b`` batch, ``n`` tokens the head reads, ``l`` latents, ``h`` heads, ``d`` head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from timm.layers.attention_pool import AttentionPoolLatent
from torch import Tensor, nn

__all__ = ["latent_rows", "latent_rows_reference", "map_refusal", "map_token_targets_refusal"]


def map_refusal(model: Any) -> str | None:
    """Why the model's attention-pooling head has no label readout (``None``: it has none, or it has one)."""
    pool = getattr(model, "attn_pool", None)
    if pool is None:
        return None
    if type(pool) is not AttentionPoolLatent:
        return f"attn_pool is {type(pool).__name__} (global_pool={model.global_pool!r}), which has no label readout; use 'map', 'token' or 'avg'"
    if pool.pool not in ("token", "avg"):
        return f"the MAP head's pool_type={pool.pool!r} returns every latent, not one readout; use pool_type 'token' or 'avg'"
    return None


def map_token_targets_refusal(model: Any, scheme: Any) -> None:
    """Refuse a scheme with per-token targets on a MAP head: the aggregate into the latents replaces the patch labels."""
    if getattr(model, "attn_pool", None) is not None and scheme.needs_token_logits:
        raise ValueError(
            "a MAP head (global_pool='map') pools the tokens by attention, so per-patch token targets "
            "(TokenLabeling) have no readout here; use TLAlign() or NoAlign(), or build the model with global_pool='avg'"
        )


def _tokens(model: Any, x: Tensor) -> Tensor:
    """The tokens the head attends over, as timm's ``pool`` hands them to ``attn_pool`` (after ``norm``):
    ViT drops the prefix tokens unless ``pool_include_prefix``; Eva passes them all."""
    return x if getattr(model, "pool_include_prefix", True) else x[:, model.num_prefix_tokens :]


def latent_rows(model: Any, x: Tensor) -> Tensor:
    """The latents' head-mean attention rows ``(b, l, n_all)`` over all ``x``'s tokens (zero on prefix tokens
    the head does not read), computed as ``AttentionPoolLatent.forward`` does; ``x`` is ``norm``'s output."""
    pool, tokens = model.attn_pool, _tokens(model, x)
    if pool.pos_embed is not None:
        tokens = tokens + pool.pos_embed.unsqueeze(0).to(tokens.dtype)
    q = rearrange(pool.q(pool.latent.expand(x.shape[0], -1, -1)), "b l (h d) -> b h l d", h=pool.num_heads)
    k, _ = rearrange(pool.kv(tokens), "b n (two h d) -> two b h n d", two=2, h=pool.num_heads)
    q, k = pool.q_norm(q), pool.k_norm(k)
    rows = ((q * pool.scale) @ k.transpose(-2, -1)).softmax(dim=-1).mean(dim=1)  # b l n
    return _pad_prefix(model, rows.detach(), x.shape[1])


def latent_rows_reference(model: Any, x: Tensor) -> Tensor:
    """``latent_rows`` in float64 from the head's weights (einsum over named axes), for the reference walk."""
    pool, tokens = model.attn_pool, _tokens(model, x).detach().double()
    if pool.pos_embed is not None:
        tokens = tokens + pool.pos_embed.detach().double()
    heads, dim = pool.num_heads, pool.head_dim
    latent = pool.latent.detach().double()[0]  # l c
    q = latent if isinstance(pool.q, nn.Identity) else nn.functional.linear(latent, pool.q.weight.double(), _b(pool.q))
    kv = nn.functional.linear(tokens, pool.kv.weight.double(), _b(pool.kv))  # b n (2 h d)
    q = rearrange(q, "l (h d) -> h l d", h=heads)
    k = rearrange(kv[..., : heads * dim], "b n (h d) -> b h n d", h=heads)
    q, k = _norm64(pool.q_norm, q), _norm64(pool.k_norm, k)
    scores = torch.einsum("hld,bhnd->bhln", q, k) * dim**-0.5
    return _pad_prefix(model, scores.softmax(dim=-1).mean(dim=1), x.shape[1])


def _b(linear: nn.Linear) -> Tensor | None:
    return None if linear.bias is None else linear.bias.detach().double()


def _norm64(norm: nn.Module, t: Tensor) -> Tensor:
    """A q/k norm applied in float64 (LayerNorm's own weights; the identity as is)."""
    if isinstance(norm, nn.Identity):
        return t
    if isinstance(norm, nn.LayerNorm):
        w = None if norm.weight is None else norm.weight.detach().double()
        b = None if norm.bias is None else norm.bias.detach().double()
        return nn.functional.layer_norm(t, norm.normalized_shape, w, b, norm.eps)
    raise ValueError(f"the MAP head's q/k norm {type(norm).__name__} has no float64 reference here; use LayerNorm")


def _pad_prefix(model: Any, rows: Tensor, n_all: int) -> Tensor:
    """Rows over the head's tokens widened to all tokens: prefix tokens it does not read get weight 0."""
    skipped = n_all - rows.shape[-1]
    return torch.cat([rows.new_zeros(*rows.shape[:-1], skipped), rows], dim=-1) if skipped else rows
