"""Adapter for timm's ResMLP: an ``MlpMixer`` of ``ResBlock``s, whose token mixing is one linear layer.

A ``ResBlock`` is ``x + ls1 * linear_tokens(Aff(x)^T)^T`` then ``x + ls2 * mlp(Aff(x))``:
``linear_tokens`` is an ``N x N`` matrix ``W`` over the patch axis, exactly Appendix D's
``W^s(Z) = W^s`` for MLP-Mixer, so Table 10's rule applies without the two-layer detour of
``_mixer.py``: ``mixed = Norm(|W|) Y`` (its bias is a constant per token, content-free).
``Affine`` (``alpha * x + beta``, per channel), the layer scales ``ls1``/``ls2`` (per channel)
and the channel MLP move no token's content to another: channel ops.

Events per block ``layer``: ``residual(layer, keep, mixed=Norm(|W|) Y)`` (linear tokens),
``residual(layer, keep, mixed=None)`` (channel MLP); readout ``pool("mean", 0)`` (no class token).

Shapes: ``b`` batch, ``n`` tokens, ``c`` channels, ``l`` label channels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from einops import rearrange
from timm.layers.mlp import GluMlp, Mlp
from timm.models.mlp_mixer import Affine, ResBlock
from torch import Tensor, nn

from mixlabels import LabelTracker
from mixlabels._label_map import fp32_labels
from mixlabels.backbones._common import branch, mix_tokens, mixing_rows
from mixlabels.backbones._dense import DenseRules, drop_path_reference as _drop, row_normalise
from mixlabels.backbones.families.mlp_mixer import AdaptedMixer, mixer_model_refusal
from mixlabels.backbones._family import Family, tiny
from timm.models.mlp_mixer import MlpMixer

__all__ = ["AdaptedResMLP", "RESMLP_FAMILY", "linear_mixing_matrices"]

RESMLP_FAMILY = (
    "timm MlpMixer with ResBlock (ResMLP: the token-mixing linear layer as the spatial mix Norm(|W|); Affine "
    "or LayerNorm norms and layer scale as channel ops; global average pooling; stochastic depth)"
)


def _resmlp_refusal(model: nn.Module) -> str | None:
    why = mixer_model_refusal(model, ResBlock)
    if why is not None:
        return why
    m: Any = model
    for i, blk in enumerate(m.blocks):
        if type(blk.linear_tokens) is not nn.Linear:
            return f"block {i}'s linear_tokens is {type(blk.linear_tokens).__name__}, not an nn.Linear over the tokens"
        for name in ("norm1", "norm2"):
            if type(getattr(blk, name)) not in (Affine, nn.LayerNorm):
                return f"block {i}'s {name} is {type(getattr(blk, name)).__name__}; only Affine or LayerNorm (per token) is supported"
        if type(blk.mlp_channels) not in (Mlp, GluMlp):
            return f"block {i}'s mlp_channels is {type(blk.mlp_channels).__name__}; only a per-token Mlp or GluMlp is supported"
    return None


def linear_mixing_matrices(linears: Sequence[nn.Linear]) -> Tensor:
    """``Norm(|W|)`` ``(g, n, n)`` fp32 of linear layers over tokens of one shape, computed together (six operators
    for all of a model's blocks, not four a block): row ``i`` is where token ``i`` draws from."""
    with torch.no_grad():  # no detach: a label matrix carries no gradient
        w = torch.stack([linear.weight for linear in linears]).float().abs_()  # g n_out n_in: a fresh stack
        return mixing_rows(w)


def _linear_tokens(blk: Any, x: Tensor) -> Tensor:
    mixed = rearrange(blk.linear_tokens(rearrange(blk.norm1(x), "b n c -> b c n")), "b c n -> b n c")
    return blk.ls1 * mixed  # type: ignore[no-any-return]


class AdaptedResMLP(AdaptedMixer):
    """A timm ResMLP (``MlpMixer`` of ``ResBlock``s) returning the scheme's aligned targets (pooled readout)."""

    family = RESMLP_FAMILY
    refusal = staticmethod(_resmlp_refusal)

    def _mixing(self, blocks: Sequence[Any]) -> Tensor:
        return linear_mixing_matrices([blk.linear_tokens for blk in blocks])

    def _mixing_shape(self, blk: Any) -> tuple[int, ...]:
        return tuple(blk.linear_tokens.weight.shape)

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker, matrices: dict[int, Tensor] | None = None) -> Tensor:
        y, mixed = tracker.labels_for(layer), None
        if y is not None:
            with fp32_labels(y.device):
                mixed = mix_tokens(self._matrix(blk, layer, matrices), y)
        out, keep = branch(blk.drop_path, _linear_tokens(blk, x))
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        out, keep = branch(blk.drop_path, blk.ls2 * blk.mlp_channels(blk.norm2(x)))
        tracker.residual(layer, keep, mixed=None)  # channel mixing
        return x + out

    def _reference_block(self, blk: Any, x: Tensor, layer: int, rules: DenseRules) -> Tensor:
        out, keep = _drop(blk.drop_path, _linear_tokens(blk, x))
        rules.mix(layer, row_normalise(blk.linear_tokens.weight.detach().double().abs()).unsqueeze(0), keep)
        x = x + out
        return x + _drop(blk.drop_path, blk.ls2 * blk.mlp_channels(blk.norm2(x)))[0]


FAMILY = Family(
    name="resmlp",
    description=RESMLP_FAMILY,
    refusal=AdaptedResMLP.refusal,
    build=AdaptedResMLP,
    example=tiny(MlpMixer, img_size=32, patch_size=8, embed_dim=32, num_blocks=2, mlp_ratio=2, block_layer=ResBlock,
        norm_layer=Affine),
    timm_modules=("mlp_mixer",),
    speed_model="resmlp_12_224",
)
