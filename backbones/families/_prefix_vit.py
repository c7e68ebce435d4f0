"""Shared body of the ViT adapters with relative position biases or rotary embeddings (rel-pos ViT, BEiT, EVA).

These models are ViTs whose attention scores get an additive per-head bias (a relative
position bias, ``attn_mask`` of the fused call) or whose q and k are rotated (RoPE on the
patch tokens). Either way the softmax rows are still the mixing weights, so the labels move
by ``mean_h(A_h) Y`` (TL-Align Eq. 9) as in ``_vit.py``, whose ``attend`` every family uses.
Events per block ``layer``: ``residual(layer, keep, mixed=...)`` (attention),
``residual(layer, keep, mixed=None)`` (MLP, SwiGLU: channel ops); layer scale, pre- and
post-norms are per token: channel ops. Readout: the class token (``"token"``) or the mean
of the patch tokens (``"avg"``, prefix tokens excluded as timm pools them).

A family subclass says how tokens are built (``_prepare``: prefix tokens, position
embeddings, a shared bias or the rotary embedding) and how a block's q, k, v and bias are
made (``_qkv``); the block loop, the dense reference and the readout are here.

Shapes: ``b`` batch, ``n`` tokens (prefix + patches), ``p`` prefix tokens, ``h`` heads,
``d`` head dim, ``l`` label channels.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.patch_embed import PatchEmbed
from torch import Tensor, nn

from mixlabels import AlignedOutput, DenseTracker, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._attention_pool import latent_rows, latent_rows_reference, map_refusal, map_token_targets_refusal
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, stride_grid
from mixlabels.backbones._fsdp import through_hooks
from mixlabels.backbones.families.vit import attend

__all__ = ["PrefixViT", "attention_output", "patch_embed_refusal", "pool_refusal", "project_qkv"]


def patch_embed_refusal(model: Any) -> str | None:
    """Why the model's patch embedding has no label rule here (``None`` if it has)."""
    if type(model.patch_embed) is not PatchEmbed:
        return f"patch_embed is {type(model.patch_embed).__name__}, not timm's PatchEmbed (its token grid has no label rule here)"
    if getattr(model.patch_embed, "dynamic_img_pad", False):
        return "dynamic_img_pad pads images, so patches no longer tile the label map; disable it"
    return None


def pool_refusal(model: Any) -> str | None:
    """Why the model's head has no label readout (``None`` if it reads the class token, averages or attention-pools)."""
    if getattr(model, "attn_pool", None) is None and model.global_pool not in ("token", "avg"):
        return f"global_pool={model.global_pool!r} has no label readout; use 'token' (with a class token), 'avg' or 'map'"
    return map_refusal(model)


def project_qkv(attn: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v ``(b, h, n, d)`` as timm's BEiT/EVA/rel-pos attentions make them, q/k norms applied.

    A fused ``qkv`` (its own bias, or BEiT/EVA's ``q_bias``/zero ``k_bias``/``v_bias``, added in
    the linear or after it as ``qkv_bias_separate`` says) or separate ``q_proj``/``k_proj``/``v_proj``
    (k and v with ``num_kv_heads`` heads for grouped-query attention, repeated after the norms).
    """
    if getattr(attn, "qkv", None) is not None:
        q_bias = getattr(attn, "q_bias", None)
        if q_bias is None:
            qkv = attn.qkv(x)
        else:
            qkv_bias = torch.cat((q_bias, attn.k_bias, attn.v_bias))
            qkv = attn.qkv(x) + qkv_bias if attn.qkv_bias_separate else F.linear(x, weight=attn.qkv.weight, bias=qkv_bias)
        q, k, v = rearrange(qkv, "b n (three h d) -> three b h n d", three=3, h=attn.num_heads)
    else:
        kv_heads = getattr(attn, "num_kv_heads", attn.num_heads)
        q = rearrange(attn.q_proj(x), "b n (h d) -> b h n d", h=attn.num_heads)
        k = rearrange(attn.k_proj(x), "b n (h d) -> b h n d", h=kv_heads)
        v = rearrange(attn.v_proj(x), "b n (h d) -> b h n d", h=kv_heads)
    q_norm, k_norm = getattr(attn, "q_norm", nn.Identity()), getattr(attn, "k_norm", nn.Identity())
    return q_norm(q), k_norm(k), v


def attention_output(attn: Any, out: Tensor, x: Tensor) -> Tensor:
    """The attention module's output ``(b, n, c)`` from its heads' ``(b, h, n, d)``: scale norm, gate, projection."""
    y = rearrange(out, "b h n d -> b n (h d)")
    y = attn.norm(y) if hasattr(attn, "norm") else y
    if getattr(attn, "gate", None) is not None:
        y = y * attn.gate(x).sigmoid()
    return attn.proj_drop(attn.proj(y))  # type: ignore[no-any-return]


def _layer_scale(blk: Any, i: int, y: Tensor) -> Tensor:
    """Branch ``i``'s per-channel gain: a ``ls{i}`` module (rel-pos ViT) or a ``gamma_{i}`` vector (BEiT, EVA)."""
    ls = getattr(blk, f"ls{i}", None)
    if ls is not None:
        return ls(y)  # type: ignore[no-any-return]
    gamma = getattr(blk, f"gamma_{i}", None)
    return y if gamma is None else gamma * y


class PrefixViT(AdaptedBase):
    """A ViT with prefix tokens whose attention takes a bias or rotated q/k; subclasses build the tokens and q, k, v."""

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The reference's labels start on the patch grid (see ``AdaptedBase.reference_bytes``)."""
        return stride_grid(label_map, self._patch_size())

    def _patch_size(self) -> tuple[int, int]:
        """The patch embedding's patch ``(h, w)``: the token grid's stride on the pixels."""
        m: Any = self.model
        return tuple(m.patch_embed.patch_size)

    def _patches(self, images: Tensor) -> Tensor:
        """The patch tokens ``b n c`` (``b h w c`` with ``dynamic_img_size``) before position embeddings."""
        m: Any = self.model
        return m.patch_embed(images)  # type: ignore[no-any-return]

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        return tuple(self.model.blocks)  # type: ignore[arg-type]  # timm is untyped

    def _prepare(self, x: Tensor) -> tuple[Tensor, Any]:
        """Patch tokens (``b n c``, or ``b h w c`` with ``dynamic_img_size``) to all tokens ``b n c``
        and what the blocks share (a shared bias, the rotary embedding), in timm's order."""
        raise NotImplementedError

    def _qkv(self, blk: Any, x: Tensor, layer: int, shared: Any) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Block ``layer``'s q, k, v ``(b, h, n, d)`` and additive bias (``None``: none) on its input ``x``."""
        raise NotImplementedError

    def _post_norm(self, blk: Any) -> bool:
        """The block normalises its branches' outputs (``x + norm(f(x))``) instead of their inputs."""
        return False

    # ------------------------------------------------------------------ shared
    def _tokens(self, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, Any, TokenLayout]:
        m: Any = self.model
        grid = check_batch(images, label_map, self._patch_size())
        x = self._patches(images)  # b n c (b h w c with dynamic_img_size)
        if label_map.token_space:  # MixToken: mix the patch embeddings, not the pixels
            flat = label_map.mix_tokens(x.flatten(1, 2) if x.ndim == 4 else x, grid)
            x = flat.view_as(x)
        x, shared = self._prepare(x)
        map_token_targets_refusal(m, self.scheme)
        p = m.num_prefix_tokens
        layout = TokenLayout(grid=grid, num_prefix=p, depth=len(m.blocks), class_token=m.global_pool == "token")
        return x, shared, layout

    def _branches(self, blk: Any) -> tuple[Any, Any]:
        """The attention branch's input and output maps (pre-norm: norm the input; post-norm: the output)."""
        if self._post_norm(blk):
            return (lambda x: x), (lambda y: blk.norm1(y))
        return blk.norm1, (lambda y: _layer_scale(blk, 1, y))

    def _mlp(self, blk: Any, x: Tensor) -> Tensor:
        if self._post_norm(blk):
            return blk.norm2(blk.mlp(x))  # type: ignore[no-any-return]
        return _layer_scale(blk, 2, blk.mlp(blk.norm2(x)))

    def _head(self, x: Tensor) -> tuple[Any, Tensor, Tensor | None]:
        """timm's own head (output, logits) and, for token labelling, the classifier on every patch token."""
        m: Any = self.model
        x = m.norm(x)
        output = m.forward_head(x)
        token_logits = None
        if self.scheme.needs_token_logits:  # LV-ViT: the classifier on every normalised patch token
            token_logits = m.head(m.head_drop(m.fc_norm(x[:, m.num_prefix_tokens :])))  # b n c
        return output, output, token_logits

    # ------------------------------------------------------------------ fast path
    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, shared, layout = self._tokens(images, label_map)
        tracker = self.scheme.start(label_map, layout)
        for layer, blk in enumerate(m.blocks):
            # the shared bias or rotary embedding is a block input, as in timm's forward (cast by a mixed-precision policy)
            x = through_hooks(blk, functools.partial(self._block, blk, layer=layer, tracker=tracker), x, shared)
        if getattr(m, "attn_pool", None) is not None:  # a MAP head: the latents' labels are their attention rows
            rows = latent_rows(m, m.norm(x))  # b l n
            tracker.aggregate(lambda y: rows @ y)
            tracker.pool("token" if m.attn_pool.pool == "token" else "mean", 0)
        else:
            tracker.pool("token", 0) if layout.class_token else tracker.pool("mean", self._first_pooled())
        output, logits, token_logits = self._head(x)
        t = tracker.finish()
        return AlignedOutput(output, logits, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def _block(self, blk: Any, x: Tensor, shared: Any, layer: int, tracker: LabelTracker) -> Tensor:
        into, out_of = self._branches(blk)
        h = into(x)
        q, k, v, bias = self._qkv(blk, h, layer, shared)
        heads, mixed = attend(blk.attn, q, k, v, layer, tracker, bias)  # b h n d, b n l
        out, keep = branch(blk.drop_path1, out_of(attention_output(blk.attn, heads, h)))
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        out, keep = branch(blk.drop_path2, self._mlp(blk, x))
        tracker.residual(layer, keep, mixed=None)  # channel mixing: labels unchanged
        return x + out

    # ------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit attention matrices (bias added, q/k rotated) on dense float64 labels."""
        m: Any = self.model
        x, shared, layout = self._tokens(images, label_map)
        tracker = DenseTracker.start(self.scheme, label_map, layout)
        for i, blk in enumerate(m.blocks):
            into, out_of = self._branches(blk)
            h = into(x)
            q, k, v, bias = self._qkv(blk, h, i, shared)
            scores = q @ k.transpose(-2, -1) * blk.attn.scale  # b h n n
            a = torch.softmax(scores if bias is None else scores + bias, dim=-1)
            heads = F.dropout(a, blk.attn.attn_drop.p, blk.attn.training) @ v
            out, keep = branch(blk.drop_path1, out_of(attention_output(blk.attn, heads, h)))
            tracker.mix(i, a.detach().double().mean(dim=1), keep)  # Eq. 9: head-mean attention on the labels
            if tracker.wants_class_attention(i):
                tracker.attend_class(a.detach().double()[:, :, 0].mean(dim=1))  # b n: the class token's row
            x = x + out
            x = x + branch(blk.drop_path2, self._mlp(blk, x))[0]  # MLP residual: Norm(Y + Y) = Y
        output, logits, token_logits = self._head(x)
        if getattr(m, "attn_pool", None) is not None:  # a MAP head: the latents' labels are their attention rows
            tracker.aggregate(latent_rows_reference(m, m.norm(x)))  # b l n
            return tracker.result(output, logits, "token" if m.attn_pool.pool == "token" else "mean", token_logits, first=0)
        if layout.class_token:
            return tracker.result(output, logits, "token", token_logits)
        return tracker.result(output, logits, "mean", token_logits, first=self._first_pooled())

    def _first_pooled(self) -> int:
        """The first token an average head pools: the first patch, or 0 where timm's ``pool_include_prefix``
        averages the prefix tokens too (NaFlexViT)."""
        m: Any = self.model
        return 0 if getattr(m, "pool_include_prefix", False) else int(m.num_prefix_tokens)
