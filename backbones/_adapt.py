"""``adapt``: pick the adapter of a model's family, or say which families exist.

The registry is the families' own declarations (``FAMILY = Family(...)`` at the end of each
file in ``backbones/families/``, found by ``backbones._family.declared_families``), then the
``any`` fallback: ``adapt`` walks it, the tests build every family's ``example`` from it,
``support_matrix`` (the README's table) runs every scheme on those same examples, and the
count tool and the benchmarks read its timm modules and speed models.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from mixlabels import Scheme
from mixlabels.backbones._any import ANY, accepts_any_model
from mixlabels.backbones._fsdp import is_sharded, order
from mixlabels.backbones._family import Family, declared_families

__all__ = ["adapt", "SUPPORTED", "Family", "FAMILIES"]

NO_FAMILY = "aligned targets follow labels through a model's token mixers"
"""How the refusal of a model no aligning family takes begins its line on the families (``_matrix`` reads it)."""

# Last: the fallback for NoAlign, taken only when no aligning family accepts the model.
_REGISTRY: list[Family] = [*declared_families(), ANY]
FAMILIES: tuple[Family, ...] = tuple(_REGISTRY)
SUPPORTED: tuple[str, ...] = tuple(f.description for f in _REGISTRY)


def _check_model(model: object) -> None:
    """Clear errors for what is not a bare timm model: wrappers say which attribute holds it."""
    from mixlabels.backbones._common import AdaptedBase  # the adapters' base (no import cycle at call time)

    if isinstance(model, AdaptedBase):
        raise TypeError(
            f"this model is already adapted ({type(model).__name__} with {type(model.scheme).__name__}): "
            "pass the timm model (adapted.model) to adapt it again with another scheme"
        )
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError(
            "adapt cannot adapt a torch.compile'd model (OptimizedModule): adapt the timm model first and compile "
            "the adapted module (torch.compile(adapt(model, scheme))), or pass the original, model._orig_mod"
        )
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        wrapper = "ddp" if isinstance(model, nn.parallel.DistributedDataParallel) else "dp"
        raise TypeError(
            f"adapt cannot adapt a {type(model).__name__} wrapper: adapt the timm model inside it "
            f"(adapt({wrapper}.module, scheme)), "
            f"or better adapt first and wrap the adapted module ({type(model).__name__}(adapt(model, scheme)))"
        )
    sharded = [name or "the model" for name, m in model.named_modules() if is_sharded(m)] if isinstance(model, nn.Module) else []
    if sharded:
        raise TypeError(
            f"adapt cannot adapt a model already sharded by FSDP2's fully_shard ({', '.join(sharded[:4])}"
            f"{' ...' if len(sharded) > 4 else ''}): adapt first, then shard: "
            + order("the adapter's blocks (adapted.fsdp_units())")
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"adapt takes a torch.nn.Module (a timm model, a torchvision model, your own classifier), got {type(model).__name__}")


def check_scheme(scheme: object) -> None:
    """Raise a clear error unless ``scheme`` is a scheme instance (``NoAlign()``, ``TLAlign(...)``, ...)."""
    if inspect.isclass(scheme):
        raise TypeError(f"scheme must be an instance, got the class {scheme.__name__}: pass {scheme.__name__}()")
    build = getattr(scheme, "build", None)
    if callable(build) and not hasattr(scheme, "start"):
        raise TypeError(f"scheme must be a scheme, got the config {type(scheme).__name__}: pass config.build()")
    if not (callable(getattr(scheme, "start", None)) and callable(getattr(scheme, "rules", None))
            and hasattr(scheme, "needs_token_logits")):
        raise TypeError(
            f"scheme must be a mixlabels scheme (NoAlign(), TransMix(), TLAlign(...), TokenLabeling(...)), "
            f"got {type(scheme).__name__}"
        )


def adapt(model: nn.Module, scheme: Scheme, reference: bool = False) -> nn.Module:
    """Wrap a timm model so that it also returns the scheme's aligned targets.

    Args:
        model: a timm model of a supported family (``SUPPORTED``), or any classifier for
            ``NoAlign``; shared, not copied.
        scheme: ``mixlabels.NoAlign()``, ``TransMix()``, ``TLAlign(...)``, ``TokenLabeling(...)``.
        reference: use the explicit, dense reference path (tests, speed baselines).

    Returns:
        A module: ``adapted(images)`` equals ``model(images)``; ``adapted(images, label_map)``
        is a ``mixlabels.AlignedOutput``. ``adapted.model is model``.

    Any classifier (a timm model of any family, a torchvision model, your own ``nn.Module``
    mapping images to logits) adapts with ``NoAlign()``; the other schemes need one of the
    aligning families.

    Raises:
        TypeError: the scheme needs a family this model is not of (the message lists those that
            exist), the model is already adapted, compiled, wrapped (DDP, DataParallel) or sharded
            (``fully_shard``: adapt first, docs/distributed.md), or the scheme is not a scheme instance.
    """
    _check_model(model)
    check_scheme(scheme)
    reasons = []
    for family in _REGISTRY[:-1]:
        why = family.refusal(model)
        if why is None:
            return family.build(model, scheme, reference)
        reasons.append((family.name, why))
    return _any_classifier(model, scheme, reference, reasons)


def _any_classifier(model: nn.Module, scheme: Scheme, reference: bool, reasons: list[tuple[str, str]]) -> nn.Module:
    """The last family: ``NoAlign`` for any classifier; every other scheme refused, saying why and what works."""
    fallback = _REGISTRY[-1]
    why = fallback.refusal(model)
    if why is not None:
        raise TypeError(f"backbones.adapt takes a torch.nn.Module mapping images to logits: {why}")
    if accepts_any_model(scheme):
        return fallback.build(model, scheme, reference)
    aligning = ", ".join(f.name for f in _REGISTRY[:-1])
    listing = "\n  - ".join(f"{f.name}: {f.description}" for f in _REGISTRY[:-1])
    # The families that take the model's class and refuse one of its parts say what to change: first, where a
    # user reads (a family that is not of its class says only that, and they are the long list below).
    name = type(model).__name__
    near = [f"{family}: {why}" for family, why in reasons if not why.startswith(f"{name} is not a ")]
    near.sort(key=lambda why: " is not a " in why)  # a part to change before a sibling family's kind of model
    first = (
        f"{type(scheme).__name__} cannot adapt this {name}: {'; '.join(near)}. NoAlign() works for any classifier.\n"
        if near else ""
    )
    raise TypeError(
        f"{first}{NO_FAMILY}, which backbones.adapt knows only for "
        f"the families {aligning}; NoAlign() (the image-level CutMix/MixUp target) works for any classifier.\n"
        f"{type(scheme).__name__} cannot adapt {name}, which is none of them: {'; '.join(why for _, why in reasons)}.\n"
        f"Supported families:\n  - {listing}"
    )
