"""The alignment event protocol: how a backbone tells a scheme what happened to its tokens.

A backbone adapter runs a model's own modules and, at every operation that moves
information between tokens, emits an *event* to a ``LabelTracker`` that a
``Scheme`` started for this batch. The tracker decides what the event does to the
labels (TL-Align's Table 10), so one scheme serves every backbone and one adapter
serves every scheme.

Events, in the order a pre-norm transformer block emits them (``layer`` counts the
spatial-mixing layers the adapter announced in ``TokenLayout.depth``, from 0):

- ``labels_for(layer)``: the current labels ``(b, n, l)`` fp32, no grad (``l`` =
  sources ``k``, or classes ``c`` for dense labels) when the scheme aligns ``layer``,
  else ``None``: then the adapter runs its ordinary (fastest) kernel and computes no
  label mix. One question, one answer: there is no separate "wants" call.
- ``wants_class_attention(layer)`` / ``class_attention(layer, weights)``: the head
  mean of the class token's attention row ``(b, n)`` (TransMix).
- ``residual(layer, keep, mixed=...)``: a residual ``Z <- Z + g(Z)`` was added, and
  ``mixed`` is the labels of ``g``: ``mean_h(A_h) @ labels`` ``(b, n, l)``, the head-mean
  attention (or normalised kernel) applied to the labels ``labels_for(layer)`` returned,
  or ``None`` when ``g`` mixes channels only (or ``labels_for(layer)`` was ``None``): its
  labels equal its input's. ``keep`` ``(b,)`` bool says which samples kept the branch
  under stochastic depth (``None``: all); ``(b, n)`` bool says it per token, where a
  drop-path draws over groups of a sample's tokens (MobileViT's per-offset sequences). The branch's labels travel in the call itself,
  so no event depends on the order of an earlier one.
- ``aggregate(merge)``: tokens were merged (patch merging, strided conv);
  ``merge`` maps labels ``(b, n, l) -> (b, n', l)`` by summing the merged tokens,
  and the tracker renormalises. Also for a change of token layout (cyclic shift).
- ``fork()`` / ``join(fork, share, ...)``: the channels split, part of them ran through
  layers (residual events between the two calls) and the parts were concatenated again:
  ``fork`` keeps the labels at the split, ``join`` forms ``Norm((1 - share) Y + share Norm(M Y_fork))``,
  ``share`` the forked part's channel fraction and ``M`` its spatial map (``merge``, or none), as
  ``Parallel.concat`` weighs a concatenation. ``keep`` there: which samples kept the forked part
  (one a stochastic depth dropped keeps its labels under the drop rule). Both parts must end on the
  same grid (no ``aggregate`` between fork and join).
- ``pool(how, first)``: the readout: ``"token"`` reads token ``first`` (the class
  token), ``"mean"`` averages tokens ``first:`` (global average pooling).
- ``finish()``: the stop-gradient targets.

Example (a tiny single-head "model" adapted by hand; see ``backbones`` for timm):
    >>> import torch
    >>> from mixlabels import TLAlign, TokenLabelMap, TokenLayout
    >>> mask = torch.zeros(2, 2, 2); mask[:, :, :1] = 1.0  # left half from the sample itself
    >>> lm = TokenLabelMap.from_mask(mask, torch.tensor([1, 0]), torch.tensor([0, 1]), num_classes=2)
    >>> tracker = TLAlign().start(lm, TokenLayout(grid=(2, 2), num_prefix=1, depth=1, class_token=True))
    >>> attn = torch.full((2, 5, 5), 0.2)  # (b, n, n): uniform attention, rows sum to 1
    >>> labels = tracker.labels_for(0)  # None if the scheme left layer 0 alone
    >>> mixed = attn @ labels if labels is not None else None
    >>> tracker.residual(0, keep=None, mixed=mixed)  # Z <- Z + attention(Z)
    >>> tracker.residual(0, keep=None, mixed=None)  # Z <- Z + mlp(Z): channel mixing, labels unchanged
    >>> tracker.pool("token", 0)
    >>> tracker.finish().target.tolist()
    [[0.5, 0.5], [0.5, 0.5]]
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Literal, Protocol

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from mixlabels._label_map import TokenLabelMap
from mixlabels._loss import soft_target_cross_entropy, token_soft_target_cross_entropy
from mixlabels._rules import Rules

__all__ = ["TokenLayout", "Fork", "LabelTracker", "Scheme", "AlignedTargets", "AlignedOutput", "Readout"]

Readout = Literal["token", "mean"]


@dataclass(frozen=True)
class TokenLayout:
    """How an adapter lays out the tokens of a batch at the start of the network.

    Args:
        grid: ``(h, w)`` patch-token grid; tokens ``num_prefix:`` are row-major over it.
        num_prefix: tokens before the patch tokens (class, distillation, register).
        depth: number of spatial-mixing layers the adapter will announce (``layer``
            runs over ``range(depth)``); schemes resolve layer choices against it.
        class_token: token 0 is a class token that the head reads.
        pixel_windows: ``(rows (h, H), cols (w, W))``: the patch tokens start as these separable
            weighted windows of the pixels (an overlapping conv stem's, row-normalised), not as
            the cells of ``grid``; ``None``, the default: each token is its cell. Not with token
            targets (``TokenLabelMap.with_token_targets``): those start on the pixels.
    """

    grid: tuple[int, int]
    num_prefix: int
    depth: int
    class_token: bool
    pixel_windows: tuple[Tensor, Tensor] | None = None

    def __post_init__(self) -> None:
        if self.pixel_windows is not None:
            rows, cols = self.pixel_windows
            if (int(rows.shape[0]), int(cols.shape[0])) != tuple(self.grid):
                raise ValueError(
                    f"pixel_windows make a {int(rows.shape[0])}x{int(cols.shape[0])} grid, but the layout's grid is "
                    f"{self.grid[0]}x{self.grid[1]}; pass the stem's output grid"
                )

    def area_weights(self, label_map: TokenLabelMap) -> Tensor:
        """The patch tokens' area weights ``(b, h*w, k)``: the cells of ``grid``, or ``pixel_windows``."""
        if self.pixel_windows is not None:
            return label_map.window_weights(*self.pixel_windows)
        return label_map.token_weights(self.grid)

    @property
    def num_tokens(self) -> int:
        return self.num_prefix + self.grid[0] * self.grid[1]


@dataclass(frozen=True, eq=False)
class Fork:
    """A tracker's labels at a channel split (``LabelTracker.fork``), to be joined again (``join``).

    Args:
        labels: ``(b, n, l)`` the aligned labels then, or ``None`` where the scheme tracks none.
        static: ``(b, n, l)`` the unaligned (input) labels then, or ``None``.
    """

    labels: Tensor | None
    static: Tensor | None


@dataclass(frozen=True, eq=False)
class AlignedTargets:
    """What a scheme hands back: stop-gradient targets.

    Args:
        target: ``(b, c)`` class distributions for the image-level logits.
        weights: ``(b, k)`` the same target as source weights (compact labels), or ``None``
            when the labels were dense.
        token_target: ``(b, n, c)`` per-patch-token distributions, when the scheme needs them.
        token_loss_weight: factor of the dense token loss (token labeling's beta).
    """

    target: Tensor
    weights: Tensor | None = None
    token_target: Tensor | None = None
    token_loss_weight: float = 0.0


@dataclass(frozen=True, eq=False)
class AlignedOutput:
    """An adapted model's result on a mixed batch: logits, targets and the scheme's loss.

    Args:
        output: exactly what the bare model returns for the images (a tensor, or the
            distilled DeiT's ``(logits, dist_logits)`` tuple when it trains distilled).
        logits: ``(b, c)`` the class-head logits the loss uses.
        target: ``(b, c)`` stop-gradient soft targets.
        weights: ``(b, k)`` the target as source weights (``None`` for dense labels).
        token_logits: ``(b, n, c)`` per-patch-token logits when the scheme trains on them.
        token_target: ``(b, n, c)`` per-patch-token targets, likewise.
        token_loss_weight: beta of ``loss = CE(logits, target) + beta * CE_tokens``.
    """

    output: Tensor | tuple[Tensor, ...]
    logits: Tensor
    target: Tensor
    weights: Tensor | None = None
    token_logits: Tensor | None = None
    token_target: Tensor | None = None
    token_loss_weight: float = 0.0

    def __post_init__(self) -> None:
        # Built in float32 (float64 on the reference path); something cast them since: a rounded target moves the loss
        # with no error. FSDP2's output cast rebuilds this dataclass from its cast fields, so it raises here.
        for name in ("target", "weights", "token_target"):
            value = getattr(self, name)
            if isinstance(value, Tensor) and value.dtype in (torch.float16, torch.bfloat16):
                raise TypeError(
                    f"AlignedOutput.{name} is {value.dtype}: aligned targets are float32, and something cast the "
                    "adapter's output. Under FSDP2, MixedPrecisionPolicy(output_dtype=...) on the adapted module casts "
                    "every float tensor of its output, the targets too: shard it with output_dtype=None (or "
                    "torch.float32) and cast out.logits yourself where you want them in half precision "
                    "(docs/distributed.md)"
                )

    def loss(self, criterion: Callable[[Tensor, Tensor], Tensor] | None = None) -> Tensor:
        """The scheme's training loss (token labeling Eq. 3: class loss + beta * token loss).

        Args:
            criterion: the class loss of ``(logits, target)``, the ``(b, c)`` soft targets; default
                soft-target cross entropy. A training script's own criterion goes here when it takes
                class probabilities, e.g. torchvision's ``nn.CrossEntropyLoss(label_smoothing=0.1)``
                (which smooths the aligned targets as it smooths torchvision's mixed ones). The token
                term, if any, stays the scheme's.
        """
        if self.logits.shape[-1] != self.target.shape[-1]:
            raise ValueError(
                f"the model outputs {self.logits.shape[-1]} classes but the label map has num_classes="
                f"{self.target.shape[-1]}; build the mixer (or the label map) with num_classes={self.logits.shape[-1]}"
            )
        loss = soft_target_cross_entropy(self.logits, self.target) if criterion is None else criterion(self.logits, self.target)
        if self.token_target is not None and self.token_logits is not None:
            loss = loss + self.token_loss_weight * token_soft_target_cross_entropy(self.token_logits, self.token_target)
        return loss


# Its tensors visible to ``torch.utils._pytree``, as a tuple's are. FSDP2 up to torch 2.11 finds a sharded root's outputs
# with ``tree_flatten`` and hooks its pre-backward on the tensors it finds there: a dataclass it cannot see into hid the
# logits, so ``fully_shard(adapted)`` alone never reduced the gradients of its backward (wrong gradients, silently;
# torch 2.12 looks into dataclasses itself). The float is context, not a leaf.
_FIELDS = tuple(f.name for f in fields(AlignedOutput) if f.name != "token_loss_weight")


def _flatten(out: AlignedOutput) -> tuple[list[Any], float]:
    return [getattr(out, n) for n in _FIELDS], out.token_loss_weight


def _flatten_with_keys(out: AlignedOutput) -> tuple[list[tuple[pytree.KeyEntry, Any]], float]:
    return [(pytree.GetAttrKey(n), getattr(out, n)) for n in _FIELDS], out.token_loss_weight


def _unflatten(values: Iterable[Any], token_loss_weight: float) -> AlignedOutput:
    return AlignedOutput(**dict(zip(_FIELDS, values, strict=True)), token_loss_weight=token_loss_weight)


def register_output_tree() -> None:
    """``AlignedOutput`` as a pytree node (done on import; again after a test took it away)."""
    pytree.register_pytree_node(
        AlignedOutput, _flatten, _unflatten, serialized_type_name="mixlabels.AlignedOutput", flatten_with_keys_fn=_flatten_with_keys
    )


register_output_tree()


class LabelTracker(Protocol):
    """The labels of one batch while a backbone runs; receives the adapter's events."""

    def labels_for(self, layer: int) -> Tensor | None:
        """Current labels ``(b, n, l)`` fp32, no grad, if the scheme aligns ``layer``; else ``None``."""
        ...

    def wants_class_attention(self, layer: int) -> bool:
        """Whether the adapter must report the class token's head-mean attention row at ``layer``."""
        ...

    def class_attention(self, layer: int, weights: Tensor, grid: tuple[int, int] | None = None) -> None:
        """The head-mean attention row of the class token ``(b, n)`` over all tokens.

        ``grid``: the patch grid the row's patch tokens lie on, where the model has changed its grid
        since the start (a pyramid with a class token); ``None``: the layout's.
        """
        ...

    def residual(self, layer: int, keep: Tensor | None, *, mixed: Tensor | None) -> None:
        """A residual branch was added; ``keep`` ``(b,)`` (or per token ``(b, n)``) bool marks samples that kept it.

        ``mixed`` ``(b, n, l)``: the branch's labels, its spatial mix applied to ``labels_for(layer)``;
        ``None`` for a branch that mixes channels only (or a layer ``labels_for`` answered ``None``).
        """
        ...

    def aggregate(self, merge: Callable[[Tensor], Tensor], *, normalised: bool = False) -> None:
        """Tokens were merged; ``merge`` sums labels ``(b, n, l) -> (b, n', l)``, and the rows are renormalised.

        ``normalised``: ``merge`` already keeps every row's sum (a row-normalised map, as averaging windows and
        renormalised convs are), so the renormalisation, three operators, is left out (rounding drift it would
        remove is removed where the targets are read out, which renormalises).
        """
        ...

    def fork(self) -> Fork:
        """The labels now, where the channels split: one part runs on (residual events), the other waits for ``join``."""
        ...

    def join(
        self, fork: Fork, share: float, *, merge: Callable[[Tensor], Tensor] | None = None, keep: Tensor | None = None,
        normalised: bool = False,
    ) -> None:
        """The parts concatenated along channels: ``Norm((1 - share) Y + share Norm(merge(Y_fork)))``.

        ``share``: the forked part's fraction of the concatenated channels; ``merge``: the forked part's spatial
        map ``(b, n, l) -> (b, n, l)`` (a conv path's label mix; ``None``: its labels as they were); ``keep``
        ``(b,)`` bool: samples that kept the forked part under stochastic depth (a dropped one keeps ``Y``
        under the drop rule). ``normalised``: ``merge`` keeps every row's sum (as ``aggregate``'s), so both
        renormalisations, six operators, are left out (the parts' rows sum to 1 already).
        Raises where the parts lie on different grids.
        """
        ...

    def pool(self, how: Readout, first: int) -> None:
        """The readout: token ``first`` (``"token"``) or the mean of tokens ``first:``."""
        ...

    def finish(self) -> AlignedTargets:
        """The stop-gradient targets of the batch."""
        ...


class Scheme(Protocol):
    """An alignment scheme: immutable configuration that owns its label ``Rules``.

    ``rules`` resolves them for one batch (layer choices against the layout, per-batch
    data such as the training progress from the label map); ``start`` returns the fast
    path's tracker of those rules (``CompactTracker``); the reference paths apply the same
    rules with ``DenseTracker``.
    """

    def rules(self, label_map: TokenLabelMap, layout: TokenLayout) -> Rules:
        """The scheme's label rules for one batch mixed as ``label_map`` (raise if it refuses the layout)."""
        ...

    @property
    def needs_token_logits(self) -> bool:
        """Whether the adapter must also return per-patch-token logits (token labeling)."""
        ...

    def start(self, label_map: TokenLabelMap, layout: TokenLayout) -> LabelTracker:
        """A tracker for one forward pass of a batch mixed as ``label_map``."""
        ...


def initial_weights(label_map: TokenLabelMap, layout: TokenLayout) -> Tensor:
    """Eq. 5: prefix tokens get the image weights, patch tokens their exact area fractions.

    Returns:
        ``(b, num_prefix + h*w, k)`` fp32.
    """
    patches = layout.area_weights(label_map)  # b n k
    if layout.num_prefix == 0:  # a CNN's, a Swin's: nothing to prepend (three operators fewer)
        return patches
    prefix = label_map.image_weights.unsqueeze(1).expand(-1, layout.num_prefix, -1)  # b p k
    return torch.cat([prefix, patches], dim=1)
