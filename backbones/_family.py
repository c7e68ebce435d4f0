"""``Family``: what a family file declares, and how the registry finds the declarations.

A family is one file in ``backbones/families/`` (as a timm model registers itself where it
is written): its adapter, and at the end a ``FAMILY = Family(...)`` naming the timm
modules it takes, its tiny test model and its speed model. ``adapt``, ``backbones.__init__``,
the support matrix, the count tool, the benchmarks and the tests read those declarations;
no other list of families exists. Files whose names start with ``_`` hold helpers that
several families share (``families/_prefix_vit.py``), and declare nothing.

A family may take torchvision's models as well as (or instead of) timm's: it names the
``torchvision.models`` builders it takes (``Family.torchvision_builders``) and its example is built
from the torchvision class (``tiny(cls, ...)``). ``docs/adding-a-family.md`` is the guide.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import timm
import torch
from torch import nn

from mixlabels import Scheme

__all__ = ["Family", "tiny", "declared_families"]


@dataclass(frozen=True)
class Family:
    """One supported model family, declared at the end of its own file.

    Args:
        name: short key (``"vit"``, ``"swin"``, ...): the file's name too.
        description: what is supported, shown in errors and the support matrix.
        refusal: why a model is not of this family (``None`` when it is).
        build: ``build(model, scheme, reference)`` the adapter.
        example: a tiny randomly initialised timm model of the family (32x32 images, 10 classes):
            what the tests and the support matrix run.
        timm_modules: the timm modules (``timm.list_models(module=...)``) holding the names this
            family may accept; ``None``: every timm name (``backbones.count_timm_names`` counts them).
        torchvision_builders: the ``torchvision.models`` builder functions (``"resnet18"``, ...) whose
            models this family may accept (``backbones.count_torchvision_names`` counts them).
        speed_model: the family's smallest timm model at its default input size: what the speed
            benchmarks time (``None``: not timed).
        class_token: whether the example's head reads a class token (TransMix needs one; the
            support matrix test expects TransMix refused where it is ``False``).
    """

    name: str
    description: str
    refusal: Callable[[nn.Module], str | None]
    build: Callable[[nn.Module, Scheme, bool], nn.Module]
    example: Callable[[], nn.Module]
    timm_modules: tuple[str, ...] | None = ()
    torchvision_builders: tuple[str, ...] = ()
    speed_model: str | None = None
    class_token: bool = False


def tiny(name: str | type[nn.Module], **kwargs: Any) -> Callable[[], nn.Module]:
    """A seeded tiny model: ``timm.create_model(name, ...)``, or the class itself where timm's
    registered variants pin an argument (``mixer_*`` fixes ``patch_size``, ``gcvit_*`` ``depths``)
    and for torchvision's models (``tiny(torchvision.models.ResNet, block=BasicBlock, layers=[1, 1, 1, 1])``)."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        if isinstance(name, str):
            model: nn.Module = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        else:
            model = name(num_classes=10, **kwargs)
        return model

    return make


def declared_families() -> tuple[Family, ...]:
    """Every ``FAMILY`` declared in ``backbones/families/``, by name.

    The order is the files' (alphabetical): a model is accepted by at most one family
    (``tests/test_family_declarations.py`` holds that on every example and every timm name of
    the declared modules), so the order decides nothing but the tables' rows.
    """
    from mixlabels.backbones import families

    found = []
    for info in sorted(pkgutil.iter_modules(families.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue  # shared helpers: no declaration
        module = importlib.import_module(f"{families.__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, Family) or family.name != info.name:
            raise ImportError(
                f"backbones/families/{info.name}.py must end with FAMILY = Family(name={info.name!r}, ...) "
                "(docs/adding-a-family.md); files holding shared helpers start with '_'"
            )
        found.append(family)
    return tuple(found)
