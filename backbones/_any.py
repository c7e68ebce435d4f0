"""``NoAlign`` for any classifier: every timm model, a torchvision model, a user's own ``nn.Module``.

The image-level target (``label_map.image_targets()``, the CutMix/MixUp target) needs
nothing from inside the model, so ``adapt(model, NoAlign())`` works for every module that
maps images ``(b, ch, H, W)`` to logits ``(b, classes)``. Schemes that follow labels
through the model (TL-Align, TransMix, token labeling) need a family adapter and are
refused by ``adapt`` for models outside the aligning families.

MixToken mixes patch embeddings, not pixels, so it needs the place where they are made:
the model's ``patch_embed`` submodule, the standard timm attribute. Its output is mixed
in place through a forward hook for exactly one call: tokens ``(b, n, c)``, a grid
``(b, h, w, c)`` or ``(b, c, h, w)`` (``output_fmt`` decides, else the shape), or a tuple
whose first item is such a tensor (XCiT's ``(tokens, (h, w))``). A model without
``patch_embed`` refuses MixToken by name.

Shapes: ``b`` batch, ``n`` tokens, ``h w`` the token grid, ``c`` channels.
"""

from __future__ import annotations

import math
from typing import Any, overload

from einops import rearrange
import torch
from torch import Tensor, nn

from mixlabels import AlignedOutput, Scheme, TokenLabelMap, TokenLayout
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._timm_face import TimmFace, check_distributed, check_label_map, check_label_map_type

__all__ = ["AdaptedClassifier", "ANY", "ANY_FAMILY", "any_refusal", "accepts_any_model"]

ANY_FAMILY = (
    "any nn.Module mapping images (b, ch, H, W) to logits (b, classes): every timm model, torchvision models, "
    "your own (NoAlign only: the image-level CutMix/MixUp target; MixToken where the model has timm's "
    "`patch_embed`; the first output of a tuple is the logits)"
)


def any_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a classifier module at all (``None``: any ``nn.Module`` is)."""
    if not isinstance(model, nn.Module):
        return f"{type(model).__name__} is not a torch.nn.Module"
    return None


def accepts_any_model(scheme: Scheme) -> bool:
    """Whether ``scheme`` needs nothing from inside the model (the image-level target only).

    Asked of the scheme's own rules, not of its type: on a model with no token layers (one
    token, no class token, depth 0) they must carry no labels through layers, read no
    attention and train no tokens. A scheme that cannot even state its rules there needs what
    such a model lacks (a class token, layers, training progress).
    """
    probe = TokenLabelMap.unmixed(torch.zeros(1, dtype=torch.long), 1, (1, 1))
    try:
        rules = scheme.rules(probe, TokenLayout(grid=(1, 1), num_prefix=0, depth=0, class_token=False))
    except (ValueError, TypeError):
        return False
    return (rules.target == "image" and not rules.tracks_aligned and not rules.tracks_input
            and not rules.uses_token_targets and rules.class_attention_layer is None)


def _grid_of(tokens: Tensor, images: Tensor, patch_embed: nn.Module) -> tuple[int, int]:
    """The token grid of ``(b, n, c)`` patch embeddings: from ``patch_size``, else from the count."""
    hh, ww = int(images.shape[-2]), int(images.shape[-1])
    n = int(tokens.shape[1])
    size: Any = getattr(patch_embed, "patch_size", None)
    if size is not None:
        ph, pw = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        if hh % ph == 0 and ww % pw == 0 and (hh // ph) * (ww // pw) == n:
            return hh // ph, ww // pw
    stride = math.isqrt(hh * ww // n) if n else 0  # square patches tiling the image
    if stride and hh % stride == 0 and ww % stride == 0 and (hh // stride) * (ww // stride) == n:
        return hh // stride, ww // stride
    raise ValueError(
        f"patch_embed made {n} tokens from {hh}x{ww} images, which is no grid of square patches tiling the "
        "image, so MixToken cannot place its mask on them; use a pixel-space mixer (CutMix) with this model"
    )


def _mix_embedding(out: Any, images: Tensor, label_map: TokenLabelMap, patch_embed: nn.Module) -> Any:
    """MixToken on whatever ``patch_embed`` returned (see the module docstring)."""
    if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
        return (_mix_embedding(out[0], images, label_map, patch_embed), *out[1:])
    if not isinstance(out, Tensor) or out.ndim not in (3, 4):
        what = type(out).__name__ if not isinstance(out, Tensor) else f"a {out.ndim}-d tensor"
        raise ValueError(
            f"patch_embed returned {what}, not tokens (b, n, c) or a grid (b, h, w, c) / (b, c, h, w); "
            "MixToken cannot mix it: use a pixel-space mixer (CutMix) with this model"
        )
    if out.ndim == 3:
        return label_map.mix_tokens(out, _grid_of(out, images, patch_embed))
    pattern = "b h w c" if _channels_last(out, images, patch_embed) else "b c h w"
    flat = rearrange(out, f"{pattern} -> b (h w) c")
    grid = _grid_of(flat, images, patch_embed)
    return rearrange(label_map.mix_tokens(flat, grid), f"b (h w) c -> {pattern}", h=grid[0])


def _channels_last(grid_map: Tensor, images: Tensor, patch_embed: nn.Module) -> bool:
    """Whether a 4-d embedding is ``(b, h, w, c)``: timm's ``output_fmt`` says so, else the only
    reading whose ``h w`` tiles the image with square patches (torch's ``(b, c, h, w)`` when both do)."""
    fmt = str(getattr(patch_embed, "output_fmt", "")).upper()
    if "NHWC" in fmt or "NCHW" in fmt:
        return "NHWC" in fmt
    hh, ww = int(images.shape[-2]), int(images.shape[-1])

    def tiles(gh: int, gw: int) -> bool:
        return hh % gh == 0 and ww % gw == 0 and hh // gh == ww // gw

    return not tiles(int(grid_map.shape[2]), int(grid_map.shape[3])) and tiles(int(grid_map.shape[1]), int(grid_map.shape[2]))


class AdaptedClassifier(TimmFace):
    """Any image classifier with ``NoAlign``: ``adapted(images, label_map)`` adds the image-level target.

    ``adapted(images)`` is exactly ``model(images)``; ``adapted.model is model``. As the family
    adapters (``TimmFace``), its state dict is the model's own (no ``model.`` prefix: a checkpoint
    or an EMA copy of the adapter loads into the bare model, and a bare model's loads into it),
    and a training forward under a multi-rank process group outside DDP is refused.

    Example:
        >>> import torch, mixlabels
        >>> from mixlabels import backbones
        >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10))
        >>> adapted = backbones.adapt(model, mixlabels.NoAlign())
        >>> mask = torch.ones(2, 8, 8); mask[:, :, :2] = 0.0
        >>> lm = mixlabels.TokenLabelMap.from_mask(mask, torch.tensor([1, 0]), torch.tensor([3, 7]), num_classes=10)
        >>> out = adapted(torch.randn(2, 3, 8, 8), lm)
        >>> out.target[0, [3, 7]].tolist()
        [0.75, 0.25]
    """

    family = ANY_FAMILY

    def __init__(self, model: nn.Module, scheme: Scheme, reference: bool = False) -> None:
        super().__init__()
        why = any_refusal(model)
        if why is not None:
            raise TypeError(f"cannot adapt this model: {why}")
        if not accepts_any_model(scheme):
            raise TypeError(
                f"{type(scheme).__name__} follows labels through the model's token mixers, which this adapter "
                f"does not know; AdaptedClassifier takes NoAlign() only (use backbones.adapt for the families)"
            )
        self.model = model
        self.scheme = scheme
        self.reference = reference  # nothing to reference: the target never depends on the model

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        """None: FSDP2 shards the adapted module as the root (docs/distributed.md), the model's own forward runs
        inside it, and a NoAlign target reads no parameter."""
        return ()

    @overload
    def forward(self, images: Tensor) -> Any: ...

    @overload
    def forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput: ...

    def forward(self, images: Tensor, label_map: TokenLabelMap | None = None) -> Any:
        if label_map is None:
            return self.model(images)
        check_label_map_type(label_map)
        if images.ndim != 4 or images.shape[0] != label_map.batch_size or tuple(images.shape[-2:]) != tuple(label_map.image_size):
            raise ValueError(
                f"images {tuple(images.shape)} do not match the label map (batch {label_map.batch_size}, "
                f"{label_map.image_size[0]}x{label_map.image_size[1]} pixels); mix and adapt the same batch"
            )
        check_label_map(self, images, label_map)
        check_distributed(self)
        output = self._token_space_forward(images, label_map) if label_map.token_space else self.model(images)
        logits = output[0] if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor) else output
        if not isinstance(logits, Tensor) or tuple(logits.shape) != (label_map.batch_size, label_map.num_classes):
            got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(
                f"{type(self.model).__name__} returned {got}, but the loss needs logits of shape "
                f"(batch={label_map.batch_size}, num_classes={label_map.num_classes}); build the model with "
                f"num_classes={label_map.num_classes} (timm: reset_classifier) or mix with that many classes"
            )
        tracker = self.scheme.start(label_map, TokenLayout(grid=(1, 1), num_prefix=0, depth=0, class_token=False))
        t = tracker.finish()
        return AlignedOutput(output, logits, t.target, t.weights, None, t.token_target, t.token_loss_weight)

    def _token_space_forward(self, images: Tensor, label_map: TokenLabelMap) -> Any:
        patch_embed = getattr(self.model, "patch_embed", None)
        if not isinstance(patch_embed, nn.Module):
            raise ValueError(
                f"MixToken mixes patch embeddings, but {type(self.model).__name__} has no `patch_embed` module "
                "(timm's attribute) where they are made; use a pixel-space mixer (CutMix, RandomPatchMix) with it"
            )
        calls: list[int] = []

        def mix(module: nn.Module, args: Any, out: Any) -> Any:
            calls.append(1)
            return _mix_embedding(out, images, label_map, module) if len(calls) == 1 else out

        handle = patch_embed.register_forward_hook(mix)
        try:
            output = self.model(images)
        finally:
            handle.remove()
        if len(calls) != 1:
            raise ValueError(
                f"{type(self.model).__name__}.patch_embed ran {len(calls)} times in one forward, not once, so "
                "MixToken cannot tell which call embeds the image; use a pixel-space mixer (CutMix) with it"
            )
        return output


# The registry's last entry (backbones._adapt): not in families/, since it aligns nothing and is
# taken only when no declared family accepts the model.
ANY = Family(
    name="any",
    description=ANY_FAMILY,
    refusal=any_refusal,
    build=AdaptedClassifier,
    example=tiny("test_byobnet"),
    timm_modules=None,
)
