"""AlignedClassificationTask: a ``timm.task.TrainingTask`` that trains a timm model on label maps.

In timm's ``train.py`` the task owns the forward and the loss, and the script asks it
for the module to optimise, to wrap in DDP, to compile, to EMA and to save. Here the
module that trains is the adapter (``adapt(model, scheme)``): it shares the model's
parameters and runs the aligned forward, so DDP wraps it, ``compile`` compiles it,
and the gradients of that forward are the ones all-reduced. Everything else timm sees
is the plain model: ``get_eval_model()`` (validation), the EMA copy and the checkpoints
(plain timm state dicts, no prefixes).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from timm.loss.binary_cross_entropy import BinaryCrossEntropy
from timm.loss.cross_entropy import LabelSmoothingCrossEntropy
from timm.loss.jsd import JsdCrossEntropy
from timm.task import TrainingTask
from timm.utils.model_ema import ModelEmaV3
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from mixlabels import Scheme, TokenLabelMap, soft_target_cross_entropy, token_soft_target_cross_entropy
from mixlabels.backbones._adapt import adapt
from mixlabels.backbones._timm_face import TimmFace, distributed_world

__all__ = ["AlignedClassificationTask"]

Criterion = Callable[[Tensor, Tensor], Tensor]


# timm's losses that read (b,) class ids; the first two read nothing else (a mixed batch's soft targets break them)
_IDS_ONLY = (LabelSmoothingCrossEntropy, JsdCrossEntropy)
_TAKES_IDS = (*_IDS_ONLY, nn.CrossEntropyLoss, BinaryCrossEntropy)


def _unwrap(module: nn.Module) -> nn.Module:
    """Through ``torch.compile`` and DDP wrappers to the module they run."""
    while True:
        inner = getattr(module, "_orig_mod", None)
        if inner is None:
            inner = getattr(module, "module", None)
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def _has_ddp(module: nn.Module) -> bool:
    while True:
        if isinstance(module, DistributedDataParallel):
            return True
        inner = getattr(module, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return False
        module = inner


class AlignedClassificationTask(TrainingTask):
    """timm's ``ClassificationTask`` for mixed batches: ``task(images, label_map)`` trains with the scheme's targets.

    Args:
        model: a timm model of a supported family (``backbones.SUPPORTED``), not compiled or wrapped.
        scheme: ``mixlabels.NoAlign()``, ``TransMix()``, ``TLAlign(...)``, ``TokenLabeling(...)``.
        criterion: loss of the class logits against the targets: the ``(b, c)`` soft targets of a mixed
            batch; default soft-target cross entropy (timm's ``SoftTargetCrossEntropy``, what ``train.py``
            builds when mixing is on; its ``BinaryCrossEntropy`` works too). A batch of class ids (mixing
            off) goes to the criterion as ids when it reads them (``LabelSmoothingCrossEntropy``,
            ``nn.CrossEntropyLoss``, ``BinaryCrossEntropy``, ``JsdCrossEntropy``: what ``train.py`` builds
            without mixing), else as one-hot rows, as timm's ``ClassificationTask`` trains.
        reference: the adapter's dense reference path (tests).
        device, dtype, verbose: as ``timm.task.TrainingTask``.

    ``task(images, label_map)`` returns timm's dict: ``loss``, ``output`` (the class logits) and, for
    token labeling, ``class_loss`` and ``token_loss``. ``task(images, class_ids)`` (a batch no mixer
    touched) trains the plain model on them as timm's ``ClassificationTask`` does, so one ported
    ``train.py`` serves runs with and without mixing.

    Example:
        >>> import timm, mixlabels
        >>> model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1,
        ...                           num_heads=2, num_classes=10)
        >>> task = AlignedClassificationTask(model, mixlabels.TLAlign(), verbose=False)
        >>> mask = torch.zeros(2, 32, 32); mask[:, :, :16] = 1.0
        >>> lm = mixlabels.TokenLabelMap.from_mask(mask, torch.tensor([1, 0]), torch.tensor([3, 7]), num_classes=10)
        >>> result = task(lm.mix_pixels(torch.randn(2, 3, 32, 32)), lm)
        >>> result["loss"].backward()
        >>> sorted(result), task.get_eval_model() is model
        (['loss', 'output'], True)
    """

    def __init__(
        self,
        model: nn.Module,
        scheme: Scheme,
        criterion: Optional[Criterion] = None,
        reference: bool = False,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
        verbose: bool = True,
    ) -> None:
        super().__init__(device=device, dtype=dtype, verbose=verbose)
        adapted = adapt(model, scheme, reference)
        self.trainable_module: nn.Module = adapted
        self.scheme = scheme
        self.criterion: Criterion = criterion if criterion is not None else soft_target_cross_entropy
        # criteria that read class ids themselves (train.py's loss when mixing is off); others get one-hot rows
        self.criterion_takes_ids = isinstance(self.criterion, _TAKES_IDS)
        self.criterion_ids_only = isinstance(self.criterion, _IDS_ONLY)
        if isinstance(self.criterion, nn.Module):
            self.criterion = self.criterion.to(device=self.device)

    @property
    def plain_model(self) -> nn.Module:
        """The timm model (never compiled or wrapped): what validation, EMA and checkpoints see."""
        adapted = _unwrap(self.trainable_module)
        assert isinstance(adapted, TimmFace)
        return adapted.model

    # ------------------------------------------------------------------ timm's hooks
    def prepare_distributed(self, device_ids: Optional[list[Any]] = None, **ddp_kwargs: Any) -> AlignedClassificationTask:
        """Wrap the adapter (what trains) in ``DistributedDataParallel``: the aligned forward runs inside it."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError(
                "prepare_distributed needs an initialised process group: call torch.distributed.init_process_group "
                "(timm's train.py does it through utils.init_distributed_device) first"
            )
        if _has_ddp(self.trainable_module):
            raise RuntimeError("prepare_distributed was already called: the adapter is wrapped in DDP once")
        if device_ids is not None and all(torch.device(d).type == "cpu" for d in device_ids):
            # DDP takes device_ids for accelerator modules only; timm's train.py passes [device] even on the CPU
            # (where its own ClassificationTask then fails), so CPU ranks get None, which is what DDP wants.
            device_ids = None
        self.trainable_module = DistributedDataParallel(self.trainable_module, device_ids=device_ids, **ddp_kwargs)
        return self

    def compile(  # type: ignore[override]  # timm's TrainingTask.compile, not nn.Module.compile
        self, backend: str = "inductor", mode: Optional[str] = None, **compile_kwargs: Any
    ) -> nn.Module:
        """Compile what trains (the adapter's aligned forward) and, separately, the model for evaluation.

        Call before ``prepare_distributed`` (timm's order); returns the compiled eval model.
        """
        compiled: Any = torch.compile(self.trainable_module, backend=backend, mode=mode, **compile_kwargs)
        self.trainable_module = compiled  # an OptimizedModule: still an nn.Module
        eval_model: Any = torch.compile(self.plain_model, backend=backend, mode=mode, **compile_kwargs)
        self.eval_model = eval_model
        return eval_model  # type: ignore[no-any-return]  # torch.compile is typed as returning a callable

    def get_eval_model(self, module: Optional[nn.Module] = None, ema: bool = False) -> Optional[nn.Module]:
        """The plain timm model (compiled after ``compile``), or its EMA copy."""
        if module is None and not ema:
            compiled = getattr(self, "eval_model", None)
            return compiled if isinstance(compiled, nn.Module) else self.plain_model
        adapted = _unwrap(module) if module is not None else None
        if isinstance(adapted, TimmFace):
            return adapted.model
        resolved: Optional[nn.Module] = super().get_eval_model(module=module, ema=ema)
        return resolved

    def setup_ema(
        self, decay: float = 0.9999, use_warmup: bool = False, device: Optional[torch.device] = None, **kwargs: Any
    ) -> nn.Module:
        """``ModelEmaV3`` of the plain model: its state dict is a timm model's."""
        self.trainable_module_ema = ModelEmaV3(self.plain_model, decay=decay, use_warmup=use_warmup, device=device, **kwargs)
        ema: nn.Module = self.trainable_module_ema
        return ema

    def update_ema(self, step: Optional[int] = None) -> None:
        if self.has_ema():
            self.trainable_module_ema.update(self.plain_model, step=step)

    def get_clip_parameters(self, exclude_head: bool = False) -> Any:
        params = list(self.plain_model.parameters())
        return params[:-2] if exclude_head else params

    # ------------------------------------------------------------------ the step
    def forward(self, input: Tensor, target: Any) -> dict[str, Tensor]:
        """One training forward: the adapter (through DDP/compile when set up) and the scheme's loss.

        Args:
            input: ``(b, ch, H, W)`` mixed images.
            target: the ``TokenLabelMap`` the mixer returned with them, or ``(b,)`` class ids of an
                unmixed batch.

        Returns:
            ``{"loss", "output"}`` (class logits ``(b, c)``), plus ``class_loss`` and ``token_loss`` when
            the scheme trains token logits.
        """
        ids = isinstance(target, Tensor) and not target.is_floating_point() and target.ndim == 1
        if not ids and not isinstance(target, TokenLabelMap):
            raise TypeError(_target_refusal(target))
        if torch.is_grad_enabled() and distributed_world() > 1 and not _has_ddp(self.trainable_module):
            raise RuntimeError(
                f"training under a process group of {distributed_world()} ranks without DistributedDataParallel: "
                "gradients would not be all-reduced. Call task.prepare_distributed(device_ids=[local_rank]) "
                "after task.compile() and before training (timm's train.py does when --distributed)"
            )
        if ids:  # mixing off: the plain model's forward (through DDP/compile when set up) and the criterion
            logits = self.trainable_module(input)
            if self.criterion_takes_ids:
                return {"loss": self.criterion(logits, target), "output": logits}
            hard = torch.nn.functional.one_hot(target.long(), logits.shape[-1]).to(logits.dtype)
            return {"loss": self.criterion(logits, hard), "output": logits}
        if self.criterion_ids_only:
            raise TypeError(
                f"criterion {type(self.criterion).__name__} takes class ids, but this batch was mixed (a "
                "TokenLabelMap): its targets are the scheme's (b, c) soft targets, label smoothing already applied "
                "by the mixer. Pass criterion=None or timm's SoftTargetCrossEntropy()/BinaryCrossEntropy() "
                "(train.py builds SoftTargetCrossEntropy when mixing is on)"
            )
        assert isinstance(target, TokenLabelMap)
        out = self.trainable_module(input, target)
        class_loss = self.criterion(out.logits, out.target)
        if out.token_target is None or out.token_logits is None:
            return {"loss": class_loss, "output": out.logits}
        token_loss = token_soft_target_cross_entropy(out.token_logits, out.token_target)
        loss = class_loss + out.token_loss_weight * token_loss
        return {"loss": loss, "output": out.logits, "class_loss": class_loss.detach(), "token_loss": token_loss.detach()}


def _target_refusal(target: Any) -> str:
    """What to do when the task gets something other than a label map."""
    if isinstance(target, Tensor) and not target.is_floating_point():
        return (
            f"AlignedClassificationTask got integer targets of shape {tuple(target.shape)}: it takes (b,) class "
            "ids (an unmixed batch) or the TokenLabelMap a mixlabels mixer returns"
        )
    if isinstance(target, Tensor):
        return (
            f"AlignedClassificationTask got a {tuple(target.shape)} float target (timm's Mixup output?): its pixels "
            "were mixed where the scheme cannot see. Replace timm's Mixup/FastCollateMixup by "
            "mixlabels.strategies.timm_mixup/timm_collate_mixup (same arguments), which return a label map"
        )
    return f"AlignedClassificationTask needs the TokenLabelMap a mixer returns, got {type(target).__name__}"
