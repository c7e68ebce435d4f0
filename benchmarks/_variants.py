"""The training-step variants the speed benchmark times, their names in tables, and the one the others are divided by.

Kept apart from the code that runs them (no torch here): the reports import the names without
importing the benchmark.
"""

from __future__ import annotations

__all__ = ["BASELINE", "CONTROL", "DEFAULT_VARIANTS", "LABELS", "STEP_VARIANTS", "timm_step_note"]

STEP_VARIANTS = ("none", "cutmix", "transmix", "tlalign", "tlalign-widened", "tlalign-reference", "tlalign-cells",
                 "cutmix-again", "timm-cutmix")
# Asked for by name only: tlalign-cells measures a past route; cutmix-again is the baseline's step again through its
# own adapter (an A/A control: its ratio to the baseline is the run's noise floor, 1 but for noise); timm-cutmix is
# timm's own step (``timm_step_note``).
DEFAULT_VARIANTS = STEP_VARIANTS[:-3]
CONTROL = "cutmix-again"
BASELINE = "cutmix"
LABELS = {
    "none": "no mixing",
    "cutmix": "CutMix + NoAlign",
    "transmix": "CutMix + TransMix",
    "tlalign": "CutMix + TL-Align (fast)",
    "tlalign-widened": "CutMix + TL-Align (widened autograd)",
    "tlalign-reference": "CutMix + TL-Align (reference)",
    "tlalign-cells": "CutMix + TL-Align (box mask densified to cells)",
    "cutmix-again": "CutMix + NoAlign again (A/A control)",
    "timm-cutmix": "timm's Mixup (CutMix) + the bare model",
}


def timm_step_note(compiled: bool = False) -> str:
    """What the ``timm-cutmix`` row is, for the tables that show it (``compiled``: the table of compiled steps)."""
    return ("timm's own step, without this library (timm's batch-mode `Mixup` doing CutMix in place on pixel boxes, the "
            f"bare model{', compiled in the compiled table' if compiled else ''}, timm's `SoftTargetCrossEntropy`): its "
            f"ratio is that step over {LABELS[BASELINE]}'s, so below 1 is what our mixer and adapter cost in a step "
            "before any alignment.")
