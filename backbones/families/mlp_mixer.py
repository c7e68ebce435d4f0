"""Adapter for timm's MLP-Mixer: the token-mixing MLP as a spatial mix (TL-Align Appendix D).

Appendix D writes MLP-Mixer's token mixing as ``W^s(Z) = W^s``, a fixed ``N x N``
matrix. timm's token MLP is two layers, ``fc2(act(fc1(z)))`` over the token axis,
so there is no single matrix; we use the absolute path weights through the hidden
units, ``W^s = |W_2| |W_1|`` (``(n, hidden) @ (hidden, n)``: how strongly token ``j``
can reach token ``i``, whatever the sign or the activation), and Table 10's ``Norm``
makes every row a distribution: ``mixed = Norm(|W_2| |W_1|) Y``. Biases are point-wise.

Events per block ``layer``: ``residual(layer, keep, mixed=Norm(|W_2| |W_1|) Y)`` (token
MLP, ``Y = labels_for(layer)``), ``residual(layer, keep, mixed=None)`` (channel MLP);
readout ``pool("mean", 0)`` (no class token: TransMix refuses).

``AdaptedMixer`` walks the blocks through ``_block`` / ``_reference_block``; ResMLP
(``_resmlp.py``) and gMLP (``_gmlp.py``) are the same model class with other blocks and
override only those two.

Shapes: ``b`` batch, ``n m`` tokens, ``c`` channels, ``l`` label channels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from einops import rearrange
from timm.layers.mlp import Mlp
from timm.models.mlp_mixer import MixerBlock, MlpMixer
from torch import Tensor, nn

from mixlabels._label_map import fp32_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, mix_tokens, mixing_rows, stride_grid
from mixlabels.backbones._dense import DenseRules, drop_path_reference as _drop, row_normalise
from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedMixer", "MIXER_FAMILY", "mixer_model_refusal", "token_mixing_matrices"]

MIXER_FAMILY = (
    "timm MlpMixer with MixerBlock (token-mixing MLP as the spatial mix Norm(|W2| |W1|); "
    "global average pooling; stochastic depth)"
)


def mixer_model_refusal(model: nn.Module, block: type[nn.Module]) -> str | None:
    """Why ``model`` is not a timm ``MlpMixer`` built from ``block`` blocks with the mean readout
    (``MixerBlock``: family mlp_mixer, ``ResBlock``: resmlp, ``SpatialGatingBlock``: gmlp)."""
    if type(model) is not MlpMixer:
        return f"{type(model).__name__} is not a timm MlpMixer"
    m: Any = model
    if m.global_pool != "avg":
        return f"global_pool={m.global_pool!r} has no label readout; use 'avg'"
    for i, blk in enumerate(m.blocks):
        if type(blk) is not block:
            return (
                f"block {i} is {type(blk).__name__}, not {block.__name__} (MlpMixer blocks adapt by type: MixerBlock "
                "as mlp_mixer, ResBlock as resmlp, SpatialGatingBlock as gmlp; one type per model)"
            )
    return None


def _mixer_refusal(model: nn.Module) -> str | None:
    why = mixer_model_refusal(model, MixerBlock)
    if why is not None:
        return why
    m: Any = model
    for i, blk in enumerate(m.blocks):
        mlp = blk.mlp_tokens
        if type(mlp) is not Mlp or type(mlp.fc1) is not nn.Linear or not isinstance(mlp.norm, nn.Identity):
            return f"block {i}'s token MLP is not a plain two-layer timm Mlp"
    return None


def token_mixing_matrices(mlps: Sequence[Any]) -> Tensor:
    """``Norm(|W_2| |W_1|)`` ``(g, n, n)`` fp32 of token MLPs of one shape, computed together (nine operators for all
    of a model's blocks, not six a block): row ``i`` is where token ``i`` draws from."""
    with torch.no_grad():  # no detaches: a label matrix carries no gradient
        w1 = torch.stack([m.fc1.weight for m in mlps]).float().abs_()  # g hidden n_in: a fresh stack, so in place
        w2 = torch.stack([m.fc2.weight for m in mlps]).float().abs_()  # g n_out hidden
        return mixing_rows(torch.bmm(w2, w1))


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int]]:
    grid = check_batch(images, label_map, tuple(m.stem.patch_size))
    x = m.stem(images)  # b n c
    return (label_map.mix_tokens(x, grid) if label_map.token_space else x), grid


def _token_mlp(blk: Any, x: Tensor) -> Tensor:
    out: Tensor = rearrange(blk.mlp_tokens(rearrange(blk.norm1(x), "b n c -> b c n")), "b c n -> b n c")
    return out


class AdaptedMixer(AdaptedBase):
    """A timm MLP-Mixer whose forward also returns the scheme's aligned targets (pooled readout)."""

    family = MIXER_FAMILY
    refusal = staticmethod(_mixer_refusal)

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The reference's labels start on the patch grid (see ``AdaptedBase.reference_bytes``)."""
        m: Any = self.model
        return stride_grid(label_map, tuple(m.stem.patch_size))

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid = _embed(m, images, label_map)
        tracker = self.scheme.start(label_map, TokenLayout(grid=grid, num_prefix=0, depth=len(m.blocks), class_token=False))
        matrices = self._read_matrices(list(m.blocks), tracker)
        for layer, blk in enumerate(m.blocks):
            x = self._block(blk, x, layer, tracker, matrices)
        x = m.norm(x)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = m.head(m.head_drop(x)) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def _mixing(self, blocks: Sequence[Any]) -> Tensor:
        """The label mixes ``(g, n, n)`` of ``blocks``' token-mixing layers, computed together (subclasses: other
        ``MlpMixer`` block types)."""
        return token_mixing_matrices([blk.mlp_tokens for blk in blocks])

    def _mixing_shape(self, blk: Any) -> tuple[int, ...]:
        """The shape that decides whether blocks' mixes stack: their token-mixing weights'."""
        return tuple(blk.mlp_tokens.fc1.weight.shape) + tuple(blk.mlp_tokens.fc2.weight.shape)

    def _read_matrices(self, blocks: list[Any], tracker: LabelTracker) -> dict[int, Tensor] | None:
        """Every read layer's label mix (block ``i`` is layer ``i``), computed together before the blocks run (the
        weights do not change within a forward: FSDP2 shards these models whole, ``fsdp_units`` being empty);
        ``None`` where the blocks' shapes differ (``_block`` then computes each block's own)."""
        labels = [tracker.labels_for(layer) for layer in range(len(blocks))]
        read = [layer for layer, y in enumerate(labels) if y is not None]
        if not read or len({self._mixing_shape(blocks[i]) for i in read}) > 1:
            return None
        first = labels[read[0]]
        assert first is not None
        with fp32_labels(first.device):  # under the caller's autocast too: label mixes stay fp32
            return dict(zip(read, self._mixing([blocks[i] for i in read]).unbind(0)))

    def _matrix(self, blk: Any, layer: int, matrices: dict[int, Tensor] | None) -> Tensor:
        return self._mixing([blk])[0] if matrices is None else matrices[layer]

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker, matrices: dict[int, Tensor] | None = None) -> Tensor:
        """One ``MixerBlock`` with its events (subclasses: other ``MlpMixer`` block types); ``matrices``: the read
        layers' label mixes (``_read_matrices``), else computed here."""
        y, mixed = tracker.labels_for(layer), None
        if y is not None:
            with fp32_labels(y.device):
                mixed = mix_tokens(self._matrix(blk, layer, matrices), y)
        out, keep = branch(blk.drop_path, _token_mlp(blk, x))
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        out, keep = branch(blk.drop_path, blk.mlp_channels(blk.norm2(x)))
        tracker.residual(layer, keep, mixed=None)  # channel mixing
        return x + out

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit token-mixing matrices block by block (``_reference_block``), on dense labels."""
        m: Any = self.model
        x, grid = _embed(m, images, label_map)
        rules = DenseRules(self.scheme, label_map, grid, 0, len(m.blocks))
        for layer, blk in enumerate(m.blocks):
            x = self._reference_block(blk, x, layer, rules)
        x = m.norm(x)
        output = m.forward_head(x)
        token_logits = m.head(m.head_drop(x)) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)

    def _reference_block(self, blk: Any, x: Tensor, layer: int, rules: DenseRules) -> Tensor:
        """The path-weight matrix summed hidden unit by hidden unit."""
        w1 = blk.mlp_tokens.fc1.weight.detach().double().abs()  # hidden n
        w2 = blk.mlp_tokens.fc2.weight.detach().double().abs()  # n hidden
        paths = torch.einsum("ik,kj->ij", w2, w1)
        out, keep = _drop(blk.drop_path, _token_mlp(blk, x))
        rules.mix(layer, row_normalise(paths).unsqueeze(0), keep)
        x = x + out
        return x + _drop(blk.drop_path, blk.mlp_channels(blk.norm2(x)))[0]


FAMILY = Family(
    name="mlp_mixer",
    description=MIXER_FAMILY,
    refusal=AdaptedMixer.refusal,
    build=AdaptedMixer,
    example=tiny(MlpMixer, img_size=32, patch_size=8, embed_dim=32, num_blocks=2),
    timm_modules=("mlp_mixer",),
    speed_model="mixer_s32_224",
)
