"""Adapter for timm's gMLP: an ``MlpMixer`` of ``SpatialGatingBlock``s (the spatial gating unit).

A block is ``x + fc2(SGU(act(fc1(LN(x)))))``; the spatial gating unit splits the hidden
channels of every token into ``u, v``, normalises ``v`` per token and mixes it over the
tokens with a linear layer ``(W, b)``: ``SGU(z)_i = u_i * (sum_j W_ij v_j + b_i)``
(elementwise). Written as a linear combination of per-token "values",

    ``SGU(z)_i = sum_j W_ij (u_i * v_j) + b_i u_i``,

it is an attention-like mixer: ``u_i`` gates, as a query does, and the mixed content is
``v_j`` with weight ``W_ij``, plus token ``i``'s own ``u_i`` with weight ``b_i`` (the bias is
not a constant here: it multiplies ``u_i``). TL-Align credits an attention output to the
tokens whose values it mixes, by the normalised absolute weights, not to the query's
token; the same reading gives the rule

    ``mixed = Norm(|W| + diag(|b|)) Y``.

Why not ``Norm(|W|) Y`` alone or ``(Y + Norm(|W|) Y) / 2``: timm (and the paper)
initialise ``W ~ 0`` and ``b = 1``, where the unit is ``u_i``, a channel op that keeps
every token's content; only the bias term sees that (``Norm(|W|)`` would spread labels by
a 1e-6-scale random matrix, the half/half rule would move half of them). As ``W`` grows
the labels follow ``W`` in proportion. ``fc1``, ``fc2``, the norms and the activation are
per token (channel ops). Events per block ``layer``: one
``residual(layer, keep, mixed=Norm(|W| + diag|b|) Y)``; readout ``pool("mean", 0)``.

Shapes: ``b`` batch, ``n`` tokens, ``c`` channels, ``l`` label channels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from timm.layers.mlp import GatedMlp
from timm.models.mlp_mixer import SpatialGatingBlock, SpatialGatingUnit
from torch import Tensor, nn

from mixlabels import LabelTracker
from mixlabels._label_map import fp32_labels
from mixlabels.backbones._common import branch, mix_tokens, mixing_rows
from mixlabels.backbones._dense import DenseRules, drop_path_reference as _drop, row_normalise
from mixlabels.backbones.families.mlp_mixer import AdaptedMixer, mixer_model_refusal
from mixlabels.backbones._family import Family, tiny
from timm.models.mlp_mixer import MlpMixer

__all__ = ["AdaptedGMLP", "GMLP_FAMILY", "gating_mixing_matrices"]

GMLP_FAMILY = (
    "timm MlpMixer with SpatialGatingBlock (gMLP: the spatial gating unit u * (W v + b) as the spatial mix "
    "Norm(|W| + diag|b|), the bias weighting the token's own gate; global average pooling; stochastic depth)"
)


def _gmlp_refusal(model: nn.Module) -> str | None:
    why = mixer_model_refusal(model, SpatialGatingBlock)
    if why is not None:
        return why
    m: Any = model
    for i, blk in enumerate(m.blocks):
        mlp = blk.mlp_channels
        if type(mlp) is not GatedMlp or type(mlp.gate) is not SpatialGatingUnit:
            return f"block {i}'s mlp_channels is not timm's GatedMlp with a SpatialGatingUnit gate"
        if type(mlp.gate.proj) is not nn.Linear or type(mlp.gate.norm) is not nn.LayerNorm:
            return f"block {i}'s spatial gating unit is not an nn.Linear over tokens after a per-token LayerNorm"
        if type(mlp.norm) not in (nn.Identity, nn.LayerNorm) or type(blk.norm) is not nn.LayerNorm:
            return f"block {i}'s norms must be per-token LayerNorms (or none after the gate)"
    return None


def gating_mixing_matrices(projs: Sequence[nn.Linear]) -> Tensor:
    """``Norm(|W| + diag|b|)`` ``(g, n, n)`` fp32 of spatial gating units' token projections of one shape, computed
    together (nine operators for all of a model's blocks, not six a block)."""
    with torch.no_grad():  # no detaches: a label matrix carries no gradient
        w = torch.stack([p.weight for p in projs]).float().abs_()  # g n_out n_in: a fresh stack, so in place
        biases: list[Tensor] = [p.bias for p in projs if p.bias is not None]
        if biases:
            if len(biases) < len(projs):
                raise ValueError("gating_mixing_matrices: some projections have a bias and some not; pass one kind at a time")
            # + diag|b| without building the diagonal matrices
            w.diagonal(dim1=-2, dim2=-1).add_(torch.stack(biases).float().abs_())
        return mixing_rows(w)


class AdaptedGMLP(AdaptedMixer):
    """A timm gMLP (``MlpMixer`` of ``SpatialGatingBlock``s) returning the scheme's aligned targets (pooled readout)."""

    family = GMLP_FAMILY
    refusal = staticmethod(_gmlp_refusal)

    def _mixing(self, blocks: Sequence[Any]) -> Tensor:
        return gating_mixing_matrices([blk.mlp_channels.gate.proj for blk in blocks])

    def _mixing_shape(self, blk: Any) -> tuple[int, ...]:
        proj = blk.mlp_channels.gate.proj
        return (*proj.weight.shape, proj.bias is not None)

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker, matrices: dict[int, Tensor] | None = None) -> Tensor:
        y, mixed = tracker.labels_for(layer), None
        if y is not None:
            with fp32_labels(y.device):
                mixed = mix_tokens(self._matrix(blk, layer, matrices), y)
        out, keep = branch(blk.drop_path, blk.mlp_channels(blk.norm(x)))
        tracker.residual(layer, keep, mixed=mixed)
        return x + out

    def _reference_block(self, blk: Any, x: Tensor, layer: int, rules: DenseRules) -> Tensor:
        proj = blk.mlp_channels.gate.proj
        weights = proj.weight.detach().double().abs() + torch.diag_embed(proj.bias.detach().double().abs())
        out, keep = _drop(blk.drop_path, blk.mlp_channels(blk.norm(x)))
        rules.mix(layer, row_normalise(weights).unsqueeze(0), keep)
        return x + out


FAMILY = Family(
    name="gmlp",
    description=GMLP_FAMILY,
    refusal=AdaptedGMLP.refusal,
    build=AdaptedGMLP,
    example=tiny(MlpMixer, img_size=32, patch_size=8, embed_dim=32, num_blocks=2, mlp_ratio=2,
        block_layer=SpatialGatingBlock, mlp_layer=GatedMlp),
    timm_modules=("mlp_mixer",),
    speed_model="gmlp_ti16_224",
)
