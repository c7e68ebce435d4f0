"""One training set-up for every benchmark that runs a step: model, batch, mixer, adapters, optimizer.

``speed.py``'s step timing, the GPU suite's steps and ``op_count.py``'s operator count all build
their step here, so what they time or count cannot drift apart: the same random-init model, the
same batch, CutMix boxes snapped to the token grid, one adapter per scheme over the same model
(the adapters share its parameters) and AdamW.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from mixlabels.backbones._attention import Route

__all__ = ["TrainingSteps", "build_model", "timm_step_refusal", "token_stride"]


def build_model(name: str, num_classes: int) -> tuple[torch.nn.Module, int]:
    """A random-init timm model and its input size: ``tiny``, ``example:FAMILY`` (the registry's tiny
    32 px test model of a family, 10 classes) or any timm name at its default input size."""
    import timm

    if name == "tiny":  # DeiT-Ti's widths (192 dims, 3 heads, 12 blocks) on 32 px images, patch 4: 64 tokens
        model = timm.create_model(
            "deit_tiny_patch16_224", pretrained=False, num_classes=num_classes, img_size=32, patch_size=4
        )
        return model, 32
    if name.startswith("example:"):
        from mixlabels.backbones import FAMILIES

        families = {f.name: f for f in FAMILIES}
        family = families.get(name.removeprefix("example:"))
        if family is None:
            raise SystemExit(f"--model {name}: no such family; choose example:NAME with NAME one of {', '.join(families)}")
        if num_classes != 10:
            raise SystemExit(f"--model {name} is built with 10 classes (the registry's example); pass --num-classes 10")
        return family.example(), 32
    model = timm.create_model(name, pretrained=False, num_classes=num_classes)
    # Every timm model states its default input in its pretrained config (not every family has patch_embed.img_size).
    cfg: Any = getattr(model, "pretrained_cfg", None)
    size = cfg.get("input_size") if isinstance(cfg, dict) else None
    if not size:
        raise SystemExit(f"timm model {name} states no default input_size in its pretrained_cfg")
    return model, int(size[-1])


def token_stride(model: torch.nn.Module) -> int | None:
    """Pixels per token of the first token grid (to snap CutMix boxes to it, as the official TL-Align
    code does): the stride of the patch-embedding or stem convolution; ``None`` (pixel boxes) when there is none."""
    for attr in ("patch_embed", "stem"):
        first = getattr(model, attr, None)
        if isinstance(first, torch.nn.Module):
            convs = [mod for mod in first.modules() if isinstance(mod, torch.nn.Conv2d)]
            if convs:
                return int(convs[0].stride[0])
    return None


def timm_step_refusal(batch_size: int) -> str | None:
    """Why the ``timm-cutmix`` step cannot run on a batch of ``batch_size`` (``None``: it can)."""
    return f"timm's Mixup refuses an odd batch ({batch_size})" if batch_size % 2 else None


def _scheme(variant: str) -> Any:
    """The scheme a mixing variant adapts the model with (``speed``'s ``STEP_VARIANTS`` but ``none``)."""
    import mixlabels

    if variant in ("cutmix", "cutmix-again"):  # the control: the same step through a second adapter
        return mixlabels.NoAlign()
    if variant == "transmix":
        return mixlabels.TransMix()
    if variant.startswith("tlalign"):  # tlalign, -widened, -reference, -cells: one scheme, other routes
        return mixlabels.TLAlign()
    raise ValueError(f"no scheme for the step variant {variant!r}")


class TrainingSteps:
    """Every asked-for step variant over ONE model and optimizer, so variants can be interleaved step by step.

    Variants: ``none`` (no mixing), ``cutmix`` (CutMix + NoAlign), ``transmix``, ``tlalign`` (the fast
    path), ``tlalign-widened`` (autograd through the widened attention call), ``tlalign-reference``
    (explicit attention matrices), ``tlalign-cells`` (the box mask densified to cells), ``cutmix-again``
    (``cutmix``'s step through its own NoAlign adapter: the A/A control), ``timm-cutmix`` (timm's batch-mode
    ``Mixup`` doing CutMix in place, the bare model and timm's ``SoftTargetCrossEntropy``: a timm user's step without
    this library).

    Args:
        model_name: what ``build_model`` takes.
        num_classes: classes of the model and the labels (10 for ``example:`` models).
        batch_size: images in the one batch every step reuses.
        device: where the model and batch live.
        variants: the variants ``step`` will be asked for.
        amp: bf16 autocast (meant for CUDA).
        pixel_boxes: CutMix boxes on pixels (timm's CutMix) instead of snapped to the token grid.
        strict: raise ``adapt``'s ``TypeError`` when a scheme refuses the model; else record it in ``refused``.

    The adapters share the model's parameters, so switching variant between steps changes
    nothing about the work a step does.
    """

    def __init__(
        self, model_name: str, *, num_classes: int, batch_size: int, device: str | torch.device,
        variants: Sequence[str], amp: bool = False, pixel_boxes: bool = False, strict: bool = False,
    ) -> None:  # fmt: skip
        from mixlabels.backbones import adapt
        from mixlabels.strategies import CutMix

        torch.manual_seed(0)
        self.device = torch.device(device)
        model, size = build_model(model_name, num_classes)
        self.model = model.to(self.device).train()
        # drawn from in this order: images, labels, then whatever a caller samples with it (op_count's mix)
        self.generator = torch.Generator(device="cpu").manual_seed(0)
        self.images = torch.randn(batch_size, 3, size, size, generator=self.generator).to(self.device)
        self.labels = torch.randint(0, num_classes, (batch_size,), generator=self.generator).to(self.device)
        # Boxes snapped to the token grid, as the official TL-Align code does, or on pixels (timm's CutMix).
        patch = None if pixel_boxes else token_stride(model)
        if patch is not None and size % patch:
            patch = None  # a stride that does not tile the input (xception at 299 px): pixel boxes, as timm's CutMix
        self.mixer = CutMix(num_classes=num_classes, label_smoothing=0.1, patch_size=patch)
        self.adapted: dict[str, Any] = {}
        self.refused: dict[str, str] = {}  # variant -> why adapt refuses the model (the 'any' family: NoAlign only)
        self.timm_mixup: Any = None
        self.timm_loss: Any = None
        if "timm-cutmix" in variants:  # the bare timm step: timm's batch-mode CutMix (pixel boxes), its smoothing
            why = timm_step_refusal(batch_size)
            if why is not None:
                raise ValueError(f"the timm-cutmix step needs an even batch: {why}; pass an even --batch-size")
            from timm.data.mixup import Mixup
            from timm.loss.cross_entropy import SoftTargetCrossEntropy

            self.timm_mixup = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, mode="batch", label_smoothing=0.1,
                                    num_classes=num_classes)  # type: ignore[no-untyped-call]
            self.timm_loss = SoftTargetCrossEntropy()  # type: ignore[no-untyped-call]
        for v in variants:
            if v in ("none", "timm-cutmix"):  # the bare model: no adapter
                continue
            try:
                self.adapted[v] = adapt(self.model, _scheme(v), reference=v == "tlalign-reference")
            except TypeError as err:
                if strict:
                    raise
                self.refused[v] = str(err).splitlines()[0]
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.05)
        self.amp = amp

    @classmethod
    def for_args(cls, args: argparse.Namespace, variants: Sequence[str]) -> TrainingSteps:
        """The set-up ``speed.py``'s flags ask for: ``--model``, ``--num-classes``, ``--batch-size``, ``--device``,
        ``--no-amp`` (bf16 autocast on CUDA otherwise) and ``--pixel-boxes``; a refusing scheme is recorded."""
        device = torch.device(args.device)
        return cls(args.model, num_classes=args.num_classes, batch_size=args.batch_size, device=device,
                   variants=variants, amp=device.type == "cuda" and bool(args.amp),
                   pixel_boxes=bool(getattr(args, "pixel_boxes", False)))

    def loss(self, variant: str, mixed: torch.Tensor, label_map: Any, adapter: Any = None) -> torch.Tensor:
        """The loss of a mixing variant on a mixed batch, through ``adapter`` (e.g. compiled) or the variant's own."""
        import mixlabels

        if variant == "tlalign-cells":  # the route before mask types: token weights from a cell mask
            label_map = dataclasses.replace(label_map, mask=mixlabels.CellMask(label_map.mask.dense()))
        loss: torch.Tensor = (adapter if adapter is not None else self.adapted[variant])(mixed, label_map).loss()
        return loss

    def step(self, variant: str, route: Route | str | None = None, adapter: Any = None) -> None:
        """One full training step: mix, forward, loss, backward, AdamW.

        Args:
            variant: one of the variants built.
            route: the attention route (``backbones._attention.ROUTES``; ``tlalign-widened`` implies its own),
                ``label-convs=shifted`` / ``label-convs=conv``: how a compiled graph convolves labels
                (``backbones.compiled_label_convs``; read while tracing, so a compiled adapter traces under it), or
                ``joins=fused`` / ``joins=walk``: whether a GPU's eager walk fuses a conv net's joins
                (``backbones._joins.fused_joins``), ``matrices=launch`` / ``matrices=cpu``: up to which grid it mixes
                a conv net's labels by matrices (``backbones._common.launch_matrices``), ``residuals=folded`` /
                ``residuals=lerp``: whether it folds their residuals into the matrices
                (``backbones._convnet.folded_residuals``), ``plans=kept`` / ``plans=off``: whether it builds a label
                conv group's tap weights and matrices on all its grids at once (``backbones._grid_plan.grid_plans``).
            adapter: run the mixed batch through this (e.g. ``torch.compile`` of ``adapted[variant]``).
        """
        from mixlabels.backbones import compiled_label_convs
        from mixlabels.backbones._attention import ROUTES, attention_route
        from mixlabels.backbones._common import launch_matrices
        from mixlabels.backbones._convnet import folded_residuals
        from mixlabels.backbones._grid_plan import grid_plans
        from mixlabels.backbones._joins import fused_joins

        if route is None and variant == "tlalign-widened":
            route = "widened-autograd"
        context: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if route is not None and route.startswith("label-convs="):
            context = compiled_label_convs(route.removeprefix("label-convs="))  # type: ignore[arg-type]  # it checks
        elif route in ("joins=fused", "joins=walk"):
            context = fused_joins(route == "joins=fused")
        elif route in ("matrices=launch", "matrices=cpu"):
            context = launch_matrices(route == "matrices=launch")
        elif route in ("residuals=folded", "residuals=lerp"):
            context = folded_residuals(route == "residuals=folded")
        elif route in ("plans=kept", "plans=off"):
            context = grid_plans(route == "plans=kept")
        elif route is not None:
            if route not in ROUTES:
                raise ValueError(f"no attention route {route!r}; choose from {', '.join(ROUTES)}, label-convs=shifted|conv, "
                                 "joins=fused|walk, matrices=launch|cpu, residuals=folded|lerp or plans=kept|off")
            context = attention_route(route)  # checked above
        with context, torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            if variant == "none":
                loss = F.cross_entropy(self.model(self.images), self.labels, label_smoothing=0.1)
            elif variant == "timm-cutmix":
                # timm's Mixup mixes the batch in place, as in timm's train loop (no copy): the shared batch becomes a
                # mixed one, which changes no variant's work (the same shapes; no operator reads the pixel values)
                mixed, target = self.timm_mixup(self.images, self.labels)
                logits = (adapter if adapter is not None else self.model)(mixed)
                loss = self.timm_loss(logits, target)
            else:
                mixed, label_map = self.mixer(self.images, self.labels)
                loss = self.loss(variant, mixed, label_map, adapter)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()

    def sync(self) -> None:
        """Wait for the device (timings end here)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
