"""Alignment schemes: what the adapter's events do to the labels.

- ``NoAlign``: the image-level mix (the CutMix/MixUp baseline). Asks for nothing.
- ``TransMix``: last layer's class-token attention over the patch tokens re-weights
  the sources; the target averages it with the area weights.
- ``TLAlign``: token-label alignment (TL-Align, Eq. 5-12) in every layer or in chosen ones.
- ``TokenLabeling``: class loss plus beta times a dense per-token loss (Token Labeling
  Eq. 3-7), token targets unaligned (MixToken) or aligned through the layers.

Each scheme is immutable configuration that owns its label rules: ``rules(label_map,
layout)`` resolves them for one batch into a ``Rules`` (``mixlabels._rules``), which the
fast path's ``CompactTracker`` and the reference paths' ``DenseTracker`` both apply, so
no adapter or reference path knows which scheme it runs. Per-batch data (annotator
maps, training progress) travels in the ``TokenLabelMap``, never in the scheme.
``SCHEMES`` names every scheme's default instance.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from mixlabels._align import LabelTracker, Scheme, TokenLayout
from mixlabels._label_map import TokenLabelMap
from mixlabels._rules import Rules
from mixlabels._trackers import CompactTracker

__all__ = ["NoAlign", "TransMix", "TLAlign", "TokenLabeling", "MixPro", "DropPathRule", "SCHEMES"]

DropPathRule = Literal["follow", "official"]
"""What a block's label update does for a sample whose attention branch stochastic depth dropped.

``"follow"``: labels follow the tokens; the sample's tokens did not mix, so its labels stay.
``"official"``: the official TL-Align code's rule, ``Y <- Norm(Y + A Y)`` for every sample.
"""


@dataclass(frozen=True)
class NoAlign:
    """The image-level mix: target = ``label_map.image_targets()``; adds no work.

    Example:
        >>> NoAlign().needs_token_logits
        False
    """

    @property
    def needs_token_logits(self) -> bool:
        return False

    def rules(self, label_map: TokenLabelMap, layout: TokenLayout) -> Rules:
        return Rules()

    def start(self, label_map: TokenLabelMap, layout: TokenLayout) -> LabelTracker:
        return CompactTracker(self.rules(label_map, layout), label_map, layout)


def _no_class_token_read(scheme: str, layout: TokenLayout) -> str:
    """Why a scheme that reads the class token's attention refuses a model whose head reads no token."""
    if layout.num_prefix == 0:
        return (
            f"{scheme} reads the class token's attention, but this model has no class token "
            "(global pooling); use TLAlign() or NoAlign() instead"
        )
    # Prefix tokens but a pooling head (EVA02, BEiT v2 and ViTs built with global_pool='avg'): the class
    # token is there, but the prediction is the patch tokens' average, not what the class token attends to.
    return (
        f"{scheme} reads the attention of the class token that the head reads, but this model's head pools "
        f"the tokens (global_pool='avg', or 'map' attention pooling) and reads none of its {layout.num_prefix} prefix "
        "token(s). Build the model "
        "with token pooling, e.g. timm.create_model(name, global_pool='token') (with a class token: class_token=True "
        "where the model has that option), or use TLAlign() or NoAlign() instead"
    )


@dataclass(frozen=True)
class TransMix:
    """TransMix: ``lambda = (lambda_attn + lambda_area) / 2``.

    ``lambda_attn`` is the last layer's class-token attention (mean over heads,
    renormalised over the patch tokens) summed over each source's token area. Needs
    a class token; a pooled model gets a clear error.
    """

    @property
    def needs_token_logits(self) -> bool:
        return False

    def rules(self, label_map: TokenLabelMap, layout: TokenLayout) -> Rules:
        if not layout.class_token:
            raise ValueError(_no_class_token_read("TransMix", layout))
        return Rules(class_attention_layer=layout.depth - 1, target="attention", area_weight=0.5)

    def start(self, label_map: TokenLabelMap, layout: TokenLayout) -> LabelTracker:
        return CompactTracker(self.rules(label_map, layout), label_map, layout)


def _resolve_layers(layers: Sequence[int] | None, depth: int) -> frozenset[int]:
    if layers is None:
        return frozenset(range(depth))
    bad = [i for i in layers if not -depth <= i < depth]
    if bad:
        raise ValueError(
            f"TLAlign layers {bad} out of range for a model with {depth} layers: use 0-based indices "
            f"in [0, {depth - 1}] or negative ones from the end (-1 is the last layer)"
        )
    resolved = [i % depth for i in layers]
    if len(set(resolved)) != len(resolved):
        raise ValueError(
            f"TLAlign layers {list(layers)} name the same layer twice on a model with {depth} layers "
            f"(negative indices count from the end); list each layer once"
        )
    return frozenset(resolved)


_LAYERS_ACCEPTED = (
    "TLAlign layers takes distinct integer layer indices, 0-based (negative ones count from the end: -1 is "
    "the last layer), e.g. layers=(1, 3, 5, 7); or None to align every layer"
)


def _check_layers(layers: object) -> tuple[int, ...]:
    """``layers`` as a tuple of distinct ints, or an error saying what is accepted (never truncated)."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(f"{_LAYERS_ACCEPTED}; got {layers!r}")
    out = []
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"{_LAYERS_ACCEPTED}; got {list(layers)!r}, where {i!r} is not an integer")
        out.append(int(i))
    if not out:
        raise ValueError(f"{_LAYERS_ACCEPTED}; got no layers (NoAlign() aligns none)")
    if len(set(out)) != len(out):
        raise ValueError(f"{_LAYERS_ACCEPTED}; got {out}, which repeats a layer")
    return tuple(out)


@dataclass(frozen=True)
class TLAlign:
    """Token-label alignment (TL-Align Eq. 5-12): labels follow the tokens through attention.

    Labels start as in Eq. 5 (prefix tokens: the image weights; patch tokens: their exact
    area fractions). In each aligned layer, ``Y <- Norm(Y + mean_h(A_h) Y)`` (Eq. 11, Norm a
    simple average); MLP residuals leave labels unchanged; a sample whose attention branch
    is dropped by stochastic depth keeps its labels (``drop_path="follow"``). The target is the class token's label,
    or the mean of the patch tokens' labels for pooled models.

    Args:
        layers: 0-based indices of the aligned layers (negative counts from the end);
            ``None`` aligns every layer. Table 8's rows on a 12-layer DeiT-S:
            "Layer 12" is ``layers=(-1,)`` (or ``(11,)``), "Layer 2,4,6,8" (1-based in the
            paper) is ``layers=(1, 3, 5, 7)``.
        normalize: ``False`` is Table 8's "Normalization Disabled". Summing without the
            average (``Y <- Y + A Y``, ``Y <- Y + Y``) scales every row by the same 2 per
            residual, so a final renormalisation would make it identical to the default:
            not an ablation. We read it as the paper's stated cause, "inaccurate alignment
            at the presence of residual connections": the label update drops the residual,
            ``Y <- mean_h(A_h) Y`` (labels follow the attention alone). Rows stay on the
            simplex, so targets remain distributions (renormalised at readout anyway).
        drop_path: ``"follow"`` (default): a sample whose attention branch stochastic depth
            dropped keeps its labels in that layer: its tokens did not mix, and labels follow
            the tokens. ``"official"``: the official TL-Align code's rule, which updates every
            sample's labels (``Y <- Norm(Y + mean_h(A_h) Y)``) whether or not its branch was
            dropped; use it to reproduce the official numbers. Identical without stochastic
            depth (``drop_path_rate=0`` or eval mode).

    Example:
        >>> TLAlign(layers=(-1,)), TLAlign(layers=(1, 3, 5, 7)), TLAlign(normalize=False)  # Table 8
        (TLAlign(layers=(-1,), normalize=True, drop_path='follow'), TLAlign(layers=(1, 3, 5, 7), normalize=True, drop_path='follow'), TLAlign(layers=None, normalize=False, drop_path='follow'))
        >>> TLAlign(drop_path="official").drop_path
        'official'
    """

    layers: tuple[int, ...] | None = None
    normalize: bool = True
    drop_path: DropPathRule = "follow"

    def __init__(self, layers: Sequence[int] | None = None, normalize: bool = True, drop_path: DropPathRule = "follow") -> None:
        if drop_path not in ("follow", "official"):
            raise ValueError(
                f"TLAlign drop_path={drop_path!r} is not a rule: use 'follow' (labels of a sample whose "
                "attention branch was dropped stay) or 'official' (the official code: they mix anyway)"
            )
        object.__setattr__(self, "layers", None if layers is None else _check_layers(layers))
        if not isinstance(normalize, bool):
            raise TypeError(f"TLAlign normalize must be True or False, got {normalize!r}")
        object.__setattr__(self, "normalize", normalize)
        object.__setattr__(self, "drop_path", drop_path)

    @property
    def needs_token_logits(self) -> bool:
        return False

    def rules(self, label_map: TokenLabelMap, layout: TokenLayout) -> Rules:
        return Rules(
            align=_resolve_layers(self.layers, layout.depth),
            normalize=self.normalize,
            follow_drop=self.drop_path == "follow",
            target="aligned",
        )

    def start(self, label_map: TokenLabelMap, layout: TokenLayout) -> LabelTracker:
        return CompactTracker(self.rules(label_map, layout), label_map, layout)


@dataclass(frozen=True)
class TokenLabeling:
    """Token labeling: ``CE(class logits, y_cls) + beta * mean_i CE(token logits_i, y_i)`` (Eq. 3-4).

    Per-token logits are the model's head on its normalised patch tokens (LV-ViT).

    Args:
        beta: weight of the dense token loss (0.5 in the paper).
        aligned: ``False``: token targets are the patch tokens' area fractions and the class
            target the image mix (MixToken, Eq. 6-7). ``True``: both are aligned through every
            layer as in ``TLAlign()``: dense supervision without an annotator.

    Token labels from an annotator's score maps travel with the batch: a label map made
    with ``label_map.with_token_targets(maps)`` gives its mixed maps as the patch tokens'
    labels (carried as ``(b, n, c)``) instead of their area fractions.

    Example:
        >>> TokenLabeling(beta=0.5, aligned=True).needs_token_logits
        True
    """

    beta: float = 0.5
    aligned: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta < float("inf"):
            raise ValueError(f"TokenLabeling beta must be a finite number >= 0 (the token loss weight), got {self.beta}")

    @property
    def needs_token_logits(self) -> bool:
        return True

    def rules(self, label_map: TokenLabelMap, layout: TokenLayout) -> Rules:
        return Rules(
            align=frozenset(range(layout.depth)) if self.aligned else frozenset(),
            target="aligned" if self.aligned else "image",
            token_targets="aligned" if self.aligned else "input",
            token_loss_weight=self.beta,
        )

    def start(self, label_map: TokenLabelMap, layout: TokenLayout) -> LabelTracker:
        return CompactTracker(self.rules(label_map, layout), label_map, layout)


@dataclass(frozen=True)
class MixPro:
    """MixPro's progressive attention labeling (Zhao et al., ICLR 2023): TransMix's target, re-weighted over training.

    ``lambda = a * lambda_area + (1 - a) * lambda_attn``, ``lambda_attn`` as in ``TransMix``
    (the last layer's class-token attention summed over each source's area), and the
    progressive factor ``a`` falling linearly with the batch's training progress ``t``:
    ``a = initial + (final - initial) * t``. Early attention maps are unreliable, so early targets
    lean on the area. The progress travels with the batch (``label_map.with_progress(step /
    total_steps)``), so the scheme stays immutable configuration; a map without it is refused.

    The schedule is this library's choice, not the official code's factor: there
    (github.com/fistyee/MixPro, ``main.py``) the attention weight ``1 - a`` is, per sample,
    the cosine similarity between the area-mixed target and the model's own softmax
    prediction on the same forward pass (so it rises as the model learns), with a
    commented-out epoch schedule ``1 - (epoch / 300) ** 2`` beside it. That factor needs
    the batch's logits inside the tracker, which the event protocol does not hand it yet;
    this scheme is the explicit, data-independent schedule and does not claim MixPro's numbers.

    Args:
        initial: ``a`` at the start of training (``t = 0``).
        final: ``a`` at the end (``t = 1``); ``initial = final = 0.5`` is ``TransMix``.

    Example:
        >>> MixPro(), MixPro(initial=0.5, final=0.5)
        (MixPro(initial=1.0, final=0.0), MixPro(initial=0.5, final=0.5))
    """

    initial: float = 1.0
    final: float = 0.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.initial <= 1.0 and 0.0 <= self.final <= 1.0):
            raise ValueError(f"MixPro initial and final are area weights in [0, 1], got initial={self.initial}, final={self.final}")

    @property
    def needs_token_logits(self) -> bool:
        return False

    def area_weight(self, progress: float) -> float:
        """The progressive factor ``a`` at training progress ``progress`` in ``[0, 1]``."""
        return self.initial + (self.final - self.initial) * progress

    def rules(self, label_map: TokenLabelMap, layout: TokenLayout) -> Rules:
        if not layout.class_token:
            raise ValueError(_no_class_token_read("MixPro", layout))
        if label_map.progress is None:
            raise ValueError(
                "MixPro weighs its targets by training progress, but this batch's label map carries none: "
                "pass label_map.with_progress(step / total_steps) to the adapted model"
            )
        a = self.area_weight(label_map.progress)
        return Rules(class_attention_layer=layout.depth - 1, target="attention", area_weight=a)

    def start(self, label_map: TokenLabelMap, layout: TokenLayout) -> LabelTracker:
        return CompactTracker(self.rules(label_map, layout), label_map, layout)


SCHEMES: Mapping[str, Scheme] = MappingProxyType(
    {
        "none": NoAlign(),
        "transmix": TransMix(),
        "tl_align": TLAlign(),
        "token_labeling": TokenLabeling(),
        "mixpro": MixPro(),
    }
)
"""Every scheme's default instance by its configuration's ``kind`` (the scheme registry)."""
