"""Token fluctuation analysis (TL-Align Sec. 3.2, 4.3, App. B): what happens to a mixed batch's labels per layer.

For a timm ViT/DeiT (plain, or wrapped by ``backbones.adapt``) and a mixed batch, per
transformer block ``l``:

- **token presence** ``p(z_i)`` (Eq. 2): how much of input token ``z_i`` is present in
  all the block's mixed tokens. With the spatial-mixing matrix ``W`` in torch's
  convention (``z_out[o] = sum_i W[o, i] z_in[i]``: rows are outputs), the paper's
  contribution of ``z_i`` to ``z_out[o]`` is ``c(z_i, o) = |W[o, i]| / sum_k |W[o, k]|``
  and ``p(z_i) = sum_o c(z_i, o)``. (The printed Eq. 2 indexes ``w`` as [input, output]:
  the same formula.) For attention every row sums to 1, so ``p`` is the column sum of
  ``A``; ``sum_i p(z_i) = n`` always, so presence only redistributes: 1 means "no
  fluctuation", as for the interior tokens of a depth-wise convolution (Eq. 3).
  Multi-head attention uses ``W = mean_h(A_h)`` (Eq. 9); since each head's rows sum to
  1 this equals the head mean of the per-head presences.
- **similarity "ground-truth" mixing ratio** (App. B, Eq. 13): for mixed token
  ``z~_i^l`` and every source ``s``, ``s_s = max_j cos(z~_i^l, z_{s,j}^l)`` over all
  tokens of the un-mixed source image after the same block; ``lambda_i = softmax_s(s_s)``.
- **the ratio each scheme assigns** after block ``l``: CutMix the image's area weights
  (fixed); TransMix ``(lambda_attn + lambda_area) / 2`` from the last block's class
  attention (fixed; the per-layer value is kept too); TokenLabeling the token's own
  input area fractions (unaligned, fixed); TL-Align the labels aligned through blocks
  ``1..l`` (Eq. 9-11: ``Y <- (Y + mean_h(A_h) Y) / 2``, MLP residuals leave ``Y``).
- **RMSE** (Fig. 3) between the unaligned (CutMix) and the aligned (TL-Align) image
  targets, over the source weights ``(b, k)``. With two distinct classes this is the
  class-count-free form: on ``(b, c)`` class targets it is ``sqrt(2 / c)`` times smaller.

Analysis materialises ``(b, l, n, n)`` attention (it is not the training path): it runs
timm's own blocks with ``fused_attn`` switched off and a forward hook on
``attn.attn_drop`` that reads the softmax matrix, in eval mode, restoring both after.

Shapes, named once: ``b`` batch, ``l`` blocks, ``n`` tokens (prefix + patches), ``m``
tokens of a source image, ``k`` sources, ``d`` channels, ``h`` heads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, reduce, repeat
from torch import Tensor, nn

from mixlabels._align import TokenLayout, initial_weights
from mixlabels._label_map import TokenLabelMap
from mixlabels._rules import Rules
from mixlabels._schemes import TLAlign, TransMix

__all__ = [
    "ViTTrace",
    "trace_vit",
    "token_presence",
    "layer_presence",
    "similarity_ratio",
    "layer_similarity_ratio",
    "aligned_layer_labels",
    "transmix_layer_weights",
    "readout",
    "rmse",
    "MixingRatios",
    "LayerAnalysis",
    "analyse",
]


@dataclass(frozen=True, eq=False)
class ViTTrace:
    """Tokens and head-mean attention of every block of a ViT on one batch.

    Args:
        tokens: ``(b, l, n, d)`` the residual stream after each block (before the final norm).
        attention: ``(b, l, n, n)`` ``mean_h(A_h)`` of each block, rows = outputs, fp32.
        grid: ``(gh, gw)`` patch-token grid; tokens ``num_prefix:`` are row-major over it.
        num_prefix: class/distillation/register tokens before the patches.
        class_token: the head reads token 0 (else it averages tokens ``readout_first:``).
        readout_first: first token the average readout covers (pooled models).
    """

    tokens: Tensor
    attention: Tensor
    grid: tuple[int, int]
    num_prefix: int
    class_token: bool
    readout_first: int

    @property
    def depth(self) -> int:
        return int(self.attention.shape[1])

    @property
    def layout(self) -> TokenLayout:
        return TokenLayout(grid=self.grid, num_prefix=self.num_prefix, depth=self.depth, class_token=self.class_token)


def _vit(model: nn.Module) -> Any:
    """The timm VisionTransformer inside ``model`` (itself, or an adapter's ``.model``)."""
    m: Any = model
    for _ in range(3):
        if hasattr(m, "blocks") and hasattr(m, "patch_embed") and hasattr(m, "_pos_embed"):
            break
        m = getattr(m, "model", None)
    if m is None or not hasattr(m, "blocks"):
        raise TypeError(
            f"{type(model).__name__} is not a timm VisionTransformer (nor an adapter around one): "
            "analysis needs .patch_embed, ._pos_embed and .blocks of timm Blocks"
        )
    for i, blk in enumerate(m.blocks):
        attn = getattr(blk, "attn", None)
        if attn is None or not hasattr(attn, "fused_attn") or not hasattr(attn, "attn_drop"):
            raise TypeError(f"block {i} has no timm Attention (with fused_attn and attn_drop) to read attention from")
    return m


@contextmanager
def _explicit_attention(m: Any, store: list[Tensor]) -> Iterator[None]:
    """Eval mode, explicit attention, and a hook on every ``attn_drop`` appending ``mean_h(A_h)``."""

    def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        store.append(reduce(args[0].detach().float(), "b h n m -> b n m", "mean"))

    training = m.training
    fused = [blk.attn.fused_attn for blk in m.blocks]
    handles = [blk.attn.attn_drop.register_forward_hook(hook) for blk in m.blocks]
    try:
        m.eval()
        for blk in m.blocks:
            blk.attn.fused_attn = False  # with fused attention on, attn_drop never runs
        yield
    finally:
        for handle in handles:
            handle.remove()
        for blk, f in zip(m.blocks, fused):
            blk.attn.fused_attn = f
        m.train(training)


@torch.no_grad()
def trace_vit(model: nn.Module, images: Tensor, label_map: TokenLabelMap | None = None) -> ViTTrace:
    """Run a timm ViT block by block, recording tokens and head-mean attention.

    Args:
        model: a timm ``VisionTransformer`` or an adapter with ``.model`` (``backbones.adapt``).
        images: ``(b, 3, H, W)`` the images as fed to the model (already mixed for pixel mixers).
        label_map: only for a token-space map (MixToken): the patch embeddings are mixed.

    Returns:
        A ``ViTTrace``; the model's parameters, mode and ``fused_attn`` flags are unchanged.

    Example:
        >>> import timm, torch
        >>> vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8,
        ...                         embed_dim=16, depth=2, num_heads=2, num_classes=3)
        >>> t = trace_vit(vit, torch.randn(2, 3, 16, 16))
        >>> t.tokens.shape, t.attention.shape, t.grid
        (torch.Size([2, 2, 5, 16]), torch.Size([2, 2, 5, 5]), (2, 2))
    """
    m = _vit(model)
    ph, pw = (int(s) for s in m.patch_embed.patch_size)
    grid = (int(images.shape[-2]) // ph, int(images.shape[-1]) // pw)
    attention: list[Tensor] = []
    tokens: list[Tensor] = []
    with _explicit_attention(m, attention):
        x = m.patch_embed(images)  # b n d (or b gh gw d with dynamic_img_size)
        if label_map is not None and label_map.token_space:
            flat = x if x.ndim == 3 else rearrange(x, "b gh gw d -> b (gh gw) d")
            mixed = label_map.mix_tokens(flat, grid)
            x = mixed if x.ndim == 3 else rearrange(mixed, "b (gh gw) d -> b gh gw d", gh=grid[0])
        x = m.norm_pre(m.patch_drop(m._pos_embed(x)))  # b n d, prefix tokens first
        for blk in m.blocks:
            x = blk(x)  # timm's own block: exactly the model's tokens
            tokens.append(x.float())
    p = int(m.num_prefix_tokens)
    class_token = m.global_pool == "token"
    first = 0 if class_token or getattr(m, "pool_include_prefix", False) else p
    return ViTTrace(
        tokens=torch.stack(tokens, dim=1),
        attention=torch.stack(attention, dim=1),
        grid=grid,
        num_prefix=p,
        class_token=class_token,
        readout_first=first,
    )


def token_presence(weights: Tensor) -> Tensor:
    """Eq. 2: presence of every input token in all the outputs of a spatial mix.

    ``p(z_i) = sum_o |W[o, i]| / sum_k |W[o, k]|`` (rows of ``W`` are outputs).

    Args:
        weights: ``(..., n_out, n_in)`` spatial-mixing matrices (attention, a conv as a matrix).

    Returns:
        ``(..., n_in)``; sums to ``n_out`` over inputs (rows with no weight count 0).

    Example:
        >>> token_presence(torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.5, 0.5]])).tolist()
        [0.5, 2.0, 0.5]
    """
    w = weights.abs()
    share = w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)  # c(z_i, o)
    return reduce(share, "... o i -> ... i", "sum")


def layer_presence(trace: ViTTrace, residual: bool = False) -> Tensor:
    """Eq. 2 per block on the head-mean attention.

    Args:
        trace: from ``trace_vit``.
        residual: use the attention sub-block with its residual as TL-Align models it,
            ``W = (I + A) / 2`` (Eq. 11), so ``p = (1 + p_attention) / 2``.

    Returns:
        ``(b, l, n)`` presence of every token in each block's outputs.
    """
    presence = token_presence(trace.attention)  # b l n
    return (1.0 + presence) / 2 if residual else presence


def similarity_ratio(mixed: Tensor, sources: Tensor) -> Tensor:
    """App. B Eq. 13: softmax over sources of each mixed token's best cosine similarity.

    Args:
        mixed: ``(..., n, d)`` tokens of the mixed images.
        sources: ``(..., k, m, d)`` tokens of the ``k`` un-mixed source images, same block.

    Returns:
        ``(..., n, k)`` the similarity-based mixing ratio of every mixed token.

    Example:
        >>> z = torch.randn(5, 8)
        >>> similarity_ratio(z, torch.stack([z, z])).tolist() == [[0.5, 0.5]] * 5  # identical sources
        True
    """
    cos = torch.einsum("...nd,...kmd->...nkm", F.normalize(mixed.float(), dim=-1), F.normalize(sources.float(), dim=-1))
    best = reduce(cos, "... n k m -> ... n k", "max")  # s_k(z~_i)
    return best.softmax(dim=-1)


def layer_similarity_ratio(mixed: ViTTrace, unmixed: ViTTrace, label_map: TokenLabelMap) -> Tensor:
    """Eq. 13 after every block: mixed tokens against their sources' tokens.

    Args:
        mixed: trace of the mixed batch.
        unmixed: trace of the un-mixed batch (``label_map.sources`` indexes it).
        label_map: the batch's map.

    Returns:
        ``(b, l, n, k)``.
    """
    sources = unmixed.tokens[label_map.sources]  # b k l m d
    return similarity_ratio(mixed.tokens, rearrange(sources, "b k l m d -> b l k m d"))


def aligned_layer_labels(attention: Tensor, initial: Tensor, normalize: bool = True) -> Tensor:
    """TL-Align (Eq. 9-11) after every block: ``Y <- (Y + A Y) / 2``; the MLP residual keeps ``Y``.

    Args:
        attention: ``(b, l, n, n)`` head-mean attention per block.
        initial: ``(b, n, k)`` Eq. 5 labels (``mixlabels._align.initial_weights``) or any ``(b, n, c)``.
        normalize: ``False`` is ``TLAlign(normalize=False)``: ``Y <- A Y``.

    Returns:
        ``(b, l, n, k)`` the labels after each block.
    """
    rules = Rules(align=frozenset(range(attention.shape[1])), normalize=normalize)  # TLAlign(normalize=...)'s rules
    y = initial.float()
    out = []
    for layer in range(attention.shape[1]):
        mixed = torch.einsum("bnm,bmk->bnk", attention[:, layer].float(), y)
        y = rules.residual(y, mixed, keep=None)
        out.append(y)
    return torch.stack(out, dim=1)


def transmix_layer_weights(trace: ViTTrace, label_map: TokenLabelMap) -> Tensor:
    """TransMix's ``(lambda_attn + lambda_area) / 2`` as if computed at every block.

    ``lambda_attn`` is the class token's head-mean attention row, renormalised over the
    patch tokens, summed over each source's area (the scheme uses the last block).

    Returns:
        ``(b, l, k)``.
    """
    rules = TransMix().rules(label_map, trace.layout)  # the scheme's own rules, read at every block
    area = label_map.token_weights(trace.grid)  # b n k
    per_layer = [
        rules.combine(label_map.image_weights, rules.class_weights(trace.attention[:, layer, 0], area, trace.num_prefix))
        for layer in range(trace.depth)
    ]
    return torch.stack(per_layer, dim=1)


def readout(labels: Tensor, trace: ViTTrace) -> Tensor:
    """The image-level label the head's readout sees: the class token's, or the token mean.

    Args:
        labels: ``(b, ..., n, k)`` per-token labels.

    Returns:
        ``(b, ..., k)``.
    """
    if trace.class_token:
        return labels[..., 0, :]
    return reduce(labels[..., trace.readout_first :, :], "... n k -> ... k", "mean")


def rmse(unaligned: Tensor, aligned: Tensor) -> Tensor:
    """Root mean square error over every entry (Fig. 3 on ``(b, k)`` source weights).

    Example:
        >>> round(float(rmse(torch.tensor([[0.7, 0.3]]), torch.tensor([[0.6, 0.4]]))), 6)
        0.1
    """
    return (unaligned.float() - aligned.float()).pow(2).mean().sqrt()


@dataclass(frozen=True, eq=False)
class MixingRatios:
    """Per-block, per-token source weights ``(b, l, n, k)`` (column 0: lambda of the sample itself).

    Args:
        similarity: Eq. 13's "ground truth" (``None`` when not computed).
        cutmix: the image's area weights, every token, every block.
        transmix: TransMix's weights (last block's class attention), every token, every block.
        token_labeling: each token's own input area fractions (Eq. 5), unaligned.
        tl_align: the labels aligned through blocks ``1..l``.
        transmix_by_layer: ``(b, l, k)`` TransMix's formula on each block's attention.
    """

    similarity: Tensor | None
    cutmix: Tensor
    transmix: Tensor | None
    token_labeling: Tensor
    tl_align: Tensor
    transmix_by_layer: Tensor | None


@dataclass(frozen=True, eq=False)
class LayerAnalysis:
    """Everything the analysis computes for one mixed batch.

    Args:
        presence: ``(b, l, n)`` Eq. 2 per block (head-mean attention).
        ratios: per-block mixing ratios of the similarity ground truth and each scheme.
        cutmix_target: ``(b, k)`` the unaligned image target's source weights.
        tl_align_target: ``(b, k)`` TL-Align's target (readout of the last block's labels).
        transmix_target: ``(b, k)`` TransMix's target (``None`` without a class token).
        rmse: scalar, Fig. 3's RMSE between ``cutmix_target`` and ``tl_align_target``.
        mixed: trace of the mixed batch.
    """

    presence: Tensor
    ratios: MixingRatios
    cutmix_target: Tensor
    tl_align_target: Tensor
    transmix_target: Tensor | None
    rmse: Tensor
    mixed: ViTTrace


def analyse(
    model: nn.Module,
    images: Tensor,
    label_map: TokenLabelMap,
    mixed: Tensor | None = None,
    similarity: bool = True,
) -> LayerAnalysis:
    """Token presence, layer-wise mixing ratios and the aligned-vs-unaligned RMSE of a mixed batch.

    Args:
        model: a timm ``VisionTransformer`` or ``backbones.adapt(model, ...)``.
        images: ``(b, 3, H, W)`` the un-mixed batch (the sources ``label_map.sources`` index).
        label_map: how the batch was mixed.
        mixed: the mixed images; default ``label_map.mix_pixels(images)`` (or, for a
            token-space map, ``images`` with the patch embeddings mixed).
        similarity: also compute Eq. 13 (one more forward pass, on the un-mixed batch).

    Returns:
        A ``LayerAnalysis``.

    Example:
        >>> import timm, torch
        >>> vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8,
        ...                         embed_dim=16, depth=2, num_heads=2, num_classes=3)
        >>> mask = torch.ones(2, 16, 16); mask[:, :8] = 0.0  # top half from the partner
        >>> lm = TokenLabelMap.from_mask(mask, torch.tensor([1, 0]), torch.tensor([0, 2]), num_classes=3)
        >>> a = analyse(vit, torch.randn(2, 3, 16, 16), lm)
        >>> a.presence.shape, a.ratios.tl_align.shape, a.ratios.similarity.shape, a.rmse.shape
        (torch.Size([2, 2, 5]), torch.Size([2, 2, 5, 2]), torch.Size([2, 2, 5, 2]), torch.Size([]))
    """
    if label_map.token_space:
        trace = trace_vit(model, images if mixed is None else mixed, label_map)
    else:
        trace = trace_vit(model, label_map.mix_pixels(images) if mixed is None else mixed)
    b, depth, n = trace.attention.shape[:3]
    y0 = initial_weights(label_map, trace.layout)  # b n k, Eq. 5
    aligned = aligned_layer_labels(trace.attention, y0)  # b l n k
    rules = TLAlign().rules(label_map, trace.layout)  # the scheme's readout

    def every(weights: Tensor) -> Tensor:  # (b, k) -> (b, l, n, k)
        return repeat(weights, "b k -> b l n k", l=depth, n=n)

    transmix_by_layer = transmix_layer_weights(trace, label_map) if trace.class_token else None
    transmix_target = None if transmix_by_layer is None else transmix_by_layer[:, -1]
    sim = None
    if similarity:
        sim = layer_similarity_ratio(trace, trace_vit(model, images), label_map)
    ratios = MixingRatios(
        similarity=sim,
        cutmix=every(label_map.image_weights),
        transmix=None if transmix_target is None else every(transmix_target),
        token_labeling=repeat(y0, "b n k -> b l n k", l=depth),
        tl_align=aligned,
        transmix_by_layer=transmix_by_layer,
    )
    target = rules.readout(aligned[:, -1], "token" if trace.class_token else "mean", 0 if trace.class_token else trace.readout_first)
    return LayerAnalysis(
        presence=layer_presence(trace),
        ratios=ratios,
        cutmix_target=label_map.image_weights,
        tl_align_target=target,
        transmix_target=transmix_target,
        rmse=rmse(label_map.image_weights, target),
        mixed=trace,
    )
