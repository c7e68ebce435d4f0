"""The small timm model each aligning family is measured on (speed's per-family table, the GPU suite, op_count).

Every benchmark reads the list through ``family_models()``, so that the list can move to the
families' own declarations without touching them.
"""

from __future__ import annotations

__all__ = ["family_models", "family_names"]

# One small model per aligning family (its smallest timm variant, default input size): the per-family table.
FAMILY_MODELS = {
    "vit": "deit_tiny_patch16_224",
    "swin": "swin_tiny_patch4_window7_224",
    "pvt_v2": "pvt_v2_b0",
    "cait": "cait_xxs24_224",
    "mlp_mixer": "mixer_s32_224",
    "convnext": "convnext_atto",
    "metaformer": "poolformerv2_s12",
    "vit_relpos": "vit_relpos_small_patch16_224",
    "beit": "beit_base_patch16_224",
    "eva": "eva02_tiny_patch14_224",
    "swinv2": "swinv2_tiny_window8_256",
    "swinv2_cr": "swinv2_cr_tiny_224",
    "davit": "davit_tiny",
    "gcvit": "gcvit_xxtiny",
    "efficientvit_mit": "efficientvit_b0",
    "mvitv2": "mvitv2_tiny",
    "efficientvit_msra": "efficientvit_m0",
    "hiera": "hiera_tiny_224",
    "resmlp": "resmlp_12_224",
    "gmlp": "gmlp_ti16_224",
    "crossvit": "crossvit_tiny_240",
    "tnt": "tnt_s_patch16_224",
    "maxxvit": "maxvit_pico_rw_256",
    "twins": "twins_svt_small",
    "nest": "nest_tiny_jx",
    "focalnet": "focalnet_tiny_srf",
    "xcit": "xcit_nano_12_p16_224",
    "resnet": "resnet18",
    "efficientnet": "efficientnet_b0",
    "levit": "levit_128s",
    "mobilenetv3": "mobilenetv3_small_100",
    "mobilenetv4": "mobilenetv4_conv_small",
    "efficientformer": "efficientformer_l1",
    "volo": "volo_d1_224",
    "fastvit": "fastvit_t8",
    "regnet": "regnety_002",
    "byobnet": "mobilevit_xxs",
    "efficientformer_v2": "efficientformerv2_s0",
}


def family_models() -> dict[str, str]:
    """Family name -> the timm model measured for it, in the order the tables list the families.

    Callers use ``_families.family_models()`` (the module's attribute, not an imported name), so that
    a test can replace the list in one place.
    """
    return dict(FAMILY_MODELS)


def family_names(asked: list[str] | None) -> list[str]:
    """The families a ``--families`` flag names (every family when it names none), checked against the list."""
    models = family_models()
    unknown = [f for f in asked or () if f not in models]
    if unknown:
        raise SystemExit(f"--families {' '.join(unknown)}: unknown; choose from {', '.join(models)}")
    return list(asked or models)
