"""``adapt``: pick the adapter of a timm model's family, or say which families exist."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from backbones._vit import VIT_FAMILY, AdaptedViT, vit_refusal
from mixlabels import Scheme

__all__ = ["adapt", "SUPPORTED"]

# (family, why-not (None when the model belongs to it), build). Later families append here.
_REGISTRY: list[tuple[str, Callable[[nn.Module], str | None], Callable[[nn.Module, Scheme, bool], nn.Module]]] = [
    (VIT_FAMILY, vit_refusal, AdaptedViT),
]
SUPPORTED: tuple[str, ...] = tuple(family for family, _, _ in _REGISTRY)


def adapt(model: nn.Module, scheme: Scheme, reference: bool = False) -> nn.Module:
    """Wrap a timm model so that it also returns the scheme's aligned targets.

    Args:
        model: a timm model of a supported family (``SUPPORTED``); shared, not copied.
        scheme: ``mixlabels.NoAlign()``, ``TransMix()``, ``TLAlign(...)``, ``TokenLabeling(...)``.
        reference: use the explicit, dense reference path (tests, speed baselines).

    Returns:
        A module: ``adapted(images)`` equals ``model(images)``; ``adapted(images, label_map)``
        is a ``mixlabels.AlignedOutput``. ``adapted.model is model``.

    Raises:
        TypeError: the model's family is not supported; the message lists those that are.
    """
    reasons = []
    for family, refusal, build in _REGISTRY:
        why = refusal(model)
        if why is None:
            return build(model, scheme, reference)
        reasons.append(why)
    listing = "\n  - ".join(SUPPORTED)
    raise TypeError(
        f"backbones.adapt cannot adapt {type(model).__name__}: {'; '.join(reasons)}.\n"
        f"Supported families:\n  - {listing}"
    )
