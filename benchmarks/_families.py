"""The small timm model each aligning family is measured on (speed's per-family table, the GPU suite, op_count).

Each family declares its own (``speed_model`` in its ``FAMILY = Family(...)``, in
``backbones/families/<name>.py``); every benchmark reads them through ``family_models()``.
"""

from __future__ import annotations

from mixlabels.backbones import FAMILIES

__all__ = ["family_models", "family_names"]

def family_models() -> dict[str, str]:
    """Family name -> the timm model measured for it, in the registry's order.

    Callers use ``_families.family_models()`` (the module's attribute, not an imported name), so that
    a test can replace the list in one place.
    """
    return {f.name: f.speed_model for f in FAMILIES if f.speed_model is not None}


def family_names(asked: list[str] | None) -> list[str]:
    """The families a ``--families`` flag names (every family when it names none), checked against the list."""
    models = family_models()
    unknown = [f for f in asked or () if f not in models]
    if unknown:
        raise SystemExit(f"--families {' '.join(unknown)}: unknown; choose from {', '.join(models)}")
    return list(asked or models)
