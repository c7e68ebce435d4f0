"""The training-step variants the speed benchmark times, their names in tables, and the one the others are divided by.

Kept apart from the code that runs them (no torch here): the reports import the names without
importing the benchmark.
"""

from __future__ import annotations

__all__ = ["BASELINE", "CONTROL", "DEFAULT_VARIANTS", "LABELS", "STEP_VARIANTS"]

STEP_VARIANTS = ("none", "cutmix", "transmix", "tlalign", "tlalign-widened", "tlalign-reference", "tlalign-cells",
                 "cutmix-again", "timm-cutmix")
# Asked for by name only: tlalign-cells measures a past route; cutmix-again is the baseline's step again through its
# own adapter (an A/A control: its ratio to the baseline is the run's noise floor, 1 but for noise); timm-cutmix is the
# step a timm user runs without this library (timm's Mixup doing CutMix, the bare model, timm's soft-target loss): its
# ratio to the baseline is what dropping our mixer and adapter into that loop costs before any alignment.
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
