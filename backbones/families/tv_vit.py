"""Adapter for torchvision's VisionTransformer (vit_b_16 to vit_h_14): ``nn.MultiheadAttention`` in ``EncoderBlock``.

The events of timm's ViT family (``backbones.families.vit``, whose ``attend_sdpa`` runs the
attention here) on torchvision's modules. Per ``EncoderBlock`` ``layer``:

- ``self_attention`` (``nn.MultiheadAttention``, packed ``in_proj_weight``: q, k, v): the
  head-mean attention moves the labels, ``residual(layer, None, mixed=mean_h(A_h) Y)``, computed
  in the same fused SDPA call as the attention (``attention_with_labels``); TransMix reads the
  class token's head-mean attention row;
- the MLP branch: channel mixing, ``residual(layer, None, mixed=None)`` (no stochastic depth);
- the patch embedding (``conv_proj``, kernel = stride = patch): the labels start as the patches'
  area fractions, the class token's as the image target; readout ``pool("token", 0)``: the head
  reads the class token.

The reference walk writes every attention as its explicit ``(b, h, n, n)`` matrix on dense
float64 labels (``DenseTracker``), as ``backbones._vit_reference`` does for timm's ViT.

Shapes: ``b`` batch, ``n`` tokens (class token + patches), ``h`` heads, ``d`` head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torchvision.models.vision_transformer import EncoderBlock, VisionTransformer

from mixlabels import AlignedOutput, DenseTracker, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, stride_grid
from mixlabels.backbones._family import Family
from mixlabels.backbones.families.vit import attend_sdpa

__all__ = ["AdaptedTvViT", "TV_VIT_FAMILY", "tv_vit_refusal", "tiny_tv_vit", "mha_qkv", "mha_out", "mha_refusal"]

TV_VIT_FAMILY = (
    "torchvision VisionTransformer (vit_b/l/h; class token; nn.MultiheadAttention self-attention with packed "
    "q, k, v; dropout, attention dropout; a pre-logits head): head-mean attention moves the labels, the MLP "
    "leaves them alone; patches' area fractions at the start; the class token's attention row for TransMix"
)

BUILDERS = ("vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14")


def mha_refusal(mha: nn.Module, where: str) -> str | None:
    """Why an ``nn.MultiheadAttention`` has no label rule here (``None``: self-attention with packed q, k, v)."""
    a: Any = mha
    if type(mha) is not nn.MultiheadAttention:
        return f"{where} is {type(mha).__name__}, not nn.MultiheadAttention"
    if not a._qkv_same_embed_dim or a.bias_k is not None or a.add_zero_attn or not a.batch_first:
        return f"{where} is not batch-first self-attention with packed q, k, v (no bias_k/v, no zero attention)"
    return None


def mha_qkv(mha: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``nn.MultiheadAttention``'s packed in-projection of ``x`` ``(b, n, e)`` as ``q, k, v`` ``(b, h, n, d)``."""
    a: Any = mha
    qkv = F.linear(x, a.in_proj_weight, a.in_proj_bias)
    q, k, v = rearrange(qkv, "b n (three h d) -> three b h n d", three=3, h=a.num_heads)
    return q, k, v


def mha_out(mha: nn.Module, out: Tensor) -> Tensor:
    """``nn.MultiheadAttention``'s output projection of the heads' outputs ``(b, h, n, d)``: ``(b, n, e)`` laid out
    as ``nn.MultiheadAttention`` returns it (a view of ``(n, b, e)``), so that a dropout after it draws the same mask."""
    a: Any = mha
    projected: Tensor = a.out_proj(rearrange(out, "b h n d -> n b (h d)"))  # n b e
    return rearrange(projected, "n b e -> b n e")


def tv_vit_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a torchvision ViT this adapter carries labels through (``None``: it is)."""
    if type(model) is not VisionTransformer:
        return f"{type(model).__name__} is not a torchvision VisionTransformer"
    m: Any = model
    conv = m.conv_proj
    if type(conv) is not nn.Conv2d or conv.kernel_size != (m.patch_size,) * 2 or conv.stride != conv.kernel_size or conv.padding != (0, 0):
        return "conv_proj is a conv stem (conv_stem_configs), not a patch embedding; its token grid has no label rule here"
    for i, blk in enumerate(m.encoder.layers):
        if type(blk) is not EncoderBlock:
            return f"encoder layer {i} is {type(blk).__name__}, not torchvision's EncoderBlock"
        why = mha_refusal(blk.self_attention, f"encoder layer {i}'s self_attention")
        if why is not None:
            return why
    return None


def _tokens(m: Any, images: Tensor, label_map: TokenLabelMap, grid: tuple[int, int]) -> Tensor:
    """torchvision's embedding (patches, class token, position embedding, dropout): ``(b, 1 + n, e)``."""
    x = m._process_input(images)  # b n e
    if label_map.token_space:  # MixToken: mix the patch embeddings, not the pixels
        x = label_map.mix_tokens(x, grid)
    x = torch.cat([m.class_token.expand(x.shape[0], -1, -1), x], dim=1)
    return m.encoder.dropout(x + m.encoder.pos_embedding)  # type: ignore[no-any-return]


def _head(m: Any, x: Tensor, needs_token_logits: bool) -> tuple[Tensor, Tensor | None]:
    """The head on the class token, and (token-labelling schemes) on every patch token ``(b, n, classes)``."""
    return m.heads(x[:, 0]), (m.heads(x[:, 1:]) if needs_token_logits else None)


class AdaptedTvViT(AdaptedBase):
    """A torchvision ViT returning the scheme's aligned targets (class-token readout)."""

    family = TV_VIT_FAMILY
    refusal = staticmethod(tv_vit_refusal)

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The reference's labels start on the patch grid (see ``AdaptedBase.reference_bytes``)."""
        m: Any = self.model
        return stride_grid(label_map, m.patch_size)

    def _layout(self, images: Tensor, label_map: TokenLabelMap) -> TokenLayout:
        m: Any = self.model
        grid = check_batch(images, label_map, (m.patch_size, m.patch_size))
        return TokenLayout(grid=grid, num_prefix=1, depth=len(m.encoder.layers), class_token=True)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        layout = self._layout(images, label_map)
        x = _tokens(m, images, label_map, layout.grid)
        tracker = self.scheme.start(label_map, layout)
        for layer, blk in enumerate(m.encoder.layers):
            x = self._block(blk, x, layer, tracker)
        x = m.encoder.ln(x)
        tracker.pool("token", 0)
        output, token_logits = _head(m, x, self.scheme.needs_token_logits)
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker) -> Tensor:
        """torchvision's ``EncoderBlock.forward`` with the attention's events."""
        mha = blk.self_attention
        q, k, v = mha_qkv(mha, blk.ln_1(x))
        out, mixed = attend_sdpa(q, k, v, q.shape[-1] ** -0.5, mha.dropout if mha.training else 0.0, layer, tracker)
        x = x + blk.dropout(mha_out(mha, out))
        tracker.residual(layer, None, mixed=mixed)
        tracker.residual(layer, None, mixed=None)  # the MLP: channel mixing, labels unchanged
        return x + blk.mlp(blk.ln_2(x))  # type: ignore[no-any-return]

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Every attention as its explicit matrix, on dense float64 labels."""
        m: Any = self.model
        layout = self._layout(images, label_map)
        x = _tokens(m, images, label_map, layout.grid)
        tracker = DenseTracker.start(self.scheme, label_map, layout)
        for i, blk in enumerate(m.encoder.layers):
            mha = blk.self_attention
            q, k, v = mha_qkv(mha, blk.ln_1(x))
            a = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1)  # b h n n, the full matrix
            out = F.dropout(a, mha.dropout, mha.training) @ v
            tracker.mix(i, a.detach().double().mean(dim=1), None)  # head-mean attention on the labels
            if tracker.wants_class_attention(i):
                tracker.attend_class(a.detach().double()[:, :, 0].mean(dim=1))  # b n: the class token's row
            x = x + blk.dropout(mha_out(mha, out))
            x = x + blk.mlp(blk.ln_2(x))  # MLP residual: labels unchanged
        x = m.encoder.ln(x)
        output, token_logits = _head(m, x, self.scheme.needs_token_logits)
        return tracker.result(output, output, "token", token_logits)


def tiny_tv_vit(num_classes: int = 10, **kwargs: Any) -> VisionTransformer:
    """A seeded torchvision ViT for 32x32 images (4x4 patches of 8 px, width 32, two layers); torchvision zeroes
    the head, which would make every logit 0, so it is drawn at random here. ``kwargs`` override the sizes."""
    torch.manual_seed(0)
    sizes = {"image_size": 32, "patch_size": 8, "num_layers": 2, "num_heads": 2, "hidden_dim": 32, "mlp_dim": 64}
    model = VisionTransformer(num_classes=num_classes, **{**sizes, **kwargs})
    nn.init.normal_(model.heads[-1].weight, std=0.5)
    return model


FAMILY = Family(
    name="tv_vit",
    description=TV_VIT_FAMILY,
    refusal=AdaptedTvViT.refusal,
    build=AdaptedTvViT,
    example=tiny_tv_vit,
    timm_modules=(),
    torchvision_builders=BUILDERS,
    class_token=True,
)
