"""What an adapter shows timm's training utilities: plain state dicts, parameter groups, a DDP guard.

An adapter holds the timm model as ``.model``, so its parameters are named
``model.<name>``. timm's tools read names: a checkpoint or an EMA copy of the
adapter would carry ``model.`` prefixes that a strict ``load_state_dict`` into a
fresh timm model refuses, and ``create_optimizer_v2`` would miss the model's
``no_weight_decay`` names and layer groups. ``TimmFace`` makes the adapter's state
dict the model's own (it loads one too) and forwards ``no_weight_decay`` and
``group_matcher`` with the prefix, as timm's ``FeatureDistillationTrainableModule`` does.

It also refuses the one silent failure of distributed training: a training forward
under a process group of several ranks that runs neither inside ``DistributedDataParallel``
nor as FSDP2's root (``fully_shard(adapted)``), whose gradients would never be reduced; and it checks
the values of a hand-built label map where it enters the model (``check_label_map``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from timm.models import group_parameters
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from mixlabels import TokenLabelMap

__all__ = ["TimmFace", "check_distributed", "check_label_map", "check_label_map_type", "distributed_world"]

PREFIX = "model."


def _strip(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]) -> None:
    """State-dict post hook: ``<prefix>model.<name>`` becomes ``<prefix><name>``, in order."""
    inner = prefix + PREFIX
    keys = [k for k in state_dict if k.startswith(inner)]
    for k in keys:
        state_dict[prefix + k[len(inner) :]] = state_dict.pop(k)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # per-module versions (BatchNorm reads them on load)
        for k in [k for k in metadata if k == inner[:-1] or k.startswith(inner)]:
            metadata[prefix + k[len(inner) :]] = metadata.pop(k)


def _add(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-state-dict pre hook: a plain timm key ``<prefix><name>`` is loaded as ``<prefix>model.<name>``."""
    inner = prefix + PREFIX
    keys = [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]
    for k in keys:
        state_dict[inner + k[len(prefix) :]] = state_dict.pop(k)


class TimmFace(nn.Module):
    """Base of the adapters: the state dict of ``self.model`` without prefix, timm's parameter-group hooks.

    Attributes:
        check_distributed: refuse a training forward under a multi-rank process group that runs neither
            inside ``DistributedDataParallel`` nor sharded by FSDP2's ``fully_shard(adapted)`` (``False``
            turns the check off).
        check_label_values: check the values of a label map not made by a mixer (``label_map.check()``,
            a host read). ``None`` (default): every call for maps on the CPU, the first call for maps
            on an accelerator (no device sync per step); ``True``: every call; ``False``: never.
    """

    model: nn.Module

    def __init__(self) -> None:
        super().__init__()
        self.register_state_dict_post_hook(_strip)  # type: ignore[no-untyped-call]  # untyped in torch
        self.register_load_state_dict_pre_hook(_add)  # type: ignore[no-untyped-call]  # untyped in torch
        self.check_distributed = True
        self.check_label_values: bool | None = None
        self._label_values_checked = False

    def no_weight_decay(self) -> set[str]:
        """The model's ``no_weight_decay`` names under this module's names (``model.pos_embed``, ...)."""
        inner: Callable[[], set[str]] | None = getattr(self.model, "no_weight_decay", None)
        return {PREFIX + name for name in inner()} if inner is not None else set()

    def group_matcher(self, coarse: bool = False) -> Callable[[str], int] | dict[str, Any]:
        """The model's layer groups (timm's layer-wise lr decay), keyed by this module's parameter names."""
        matcher: Callable[..., Any] | None = getattr(self.model, "group_matcher", None)
        if matcher is None:
            return {}
        layer_of: dict[str, int] = group_parameters(self.model, matcher(coarse=coarse), reverse=True)
        last = max(layer_of.values(), default=0)

        def match(name: str) -> int:
            return layer_of.get(name[len(PREFIX) :], last) if name.startswith(PREFIX) else last

        return match


def distributed_world() -> int:
    """Number of ranks of the default process group (1 without one)."""
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def check_label_map_type(label_map: object) -> None:
    """Refuse, saying what to do, a second argument that is not a ``TokenLabelMap``."""
    if isinstance(label_map, TokenLabelMap):
        return
    if isinstance(label_map, torch.Tensor) and label_map.is_floating_point():
        raise TypeError(
            f"the second argument must be the TokenLabelMap a mixlabels mixer returns, got a float tensor of shape "
            f"{tuple(label_map.shape)}: mixed targets from another library's mixer (torchvision's MixUp/CutMix, "
            "timm's Mixup), which mixed the pixels where the scheme cannot see. Mix with this library instead: "
            "torchvision's get_mixup_cutmix -> mixlabels.strategies.torchvision_mixup_cutmix, timm's Mixup -> "
            "mixlabels.strategies.timm_mixup (same arguments)"
        )
    got = f"a tensor of shape {tuple(label_map.shape)}" if isinstance(label_map, torch.Tensor) else type(label_map).__name__
    raise TypeError(
        f"the second argument must be the mixer's TokenLabelMap (mixed, label_map = mixer(images, labels)), got "
        f"{got}; for an unmixed batch pass TokenLabelMap.unmixed(labels, num_classes, image_size=images.shape[-2:])"
    )


def check_label_map(adapter: nn.Module, images: torch.Tensor, label_map: TokenLabelMap) -> None:
    """Check a label map's values where it enters the model, unless a mixer vouched for them.

    A hand-built map (``TokenLabelMap(...)``, ``from_mask(..., validate=False)``, maps with token
    targets on an accelerator) whose weights sum to 1.4 or are negative would train silently.
    ``adapter.check_label_values`` decides when (see ``TimmFace``); skipped while compiling,
    where the host read would break the graph.
    """
    if torch.compiler.is_compiling() or label_map.validated:
        return
    if label_map.device != images.device or label_map.device.type == "meta":
        return  # no values to read here; the adapter's batch check refuses the devices by name
    when: bool | None = getattr(adapter, "check_label_values", None)
    if when is None:
        when = label_map.device.type == "cpu" or not getattr(adapter, "_label_values_checked", False)
    if when:
        try:
            label_map.check()
        except ValueError as e:
            raise ValueError(
                f"the label map passed to {type(adapter).__name__} is invalid: {e}. (Maps from this library's mixers "
                "are valid by construction; a hand-built map is checked where it enters the model)"
            ) from None
        setattr(adapter, "_label_values_checked", True)  # nn.Module's __setattr__ types attributes as tensors or modules


def check_distributed(adapter: TimmFace) -> None:
    """Refuse a training forward that would leave gradients un-reduced across ranks.

    Skipped while compiling (the task checks its structure instead), without grad, in eval
    mode and in a single process. FSDP2's root (``fully_shard(adapted)``) reduces them.
    """
    if torch.compiler.is_compiling() or not adapter.check_distributed or not torch.is_grad_enabled():
        return
    if not adapter.model.training or distributed_world() == 1 or isinstance(adapter, FSDPModule):
        return
    if not any(p.requires_grad for p in adapter.model.parameters()):
        return
    active = getattr(DistributedDataParallel, "_active_ddp_module", None)
    if active is not None and any(m is adapter for m in active.module.modules()):
        return
    raise RuntimeError(
        f"{type(adapter).__name__} ran a training forward under a torch.distributed process group of "
        f"{distributed_world()} ranks, outside DistributedDataParallel and not sharded by FSDP2: its gradients would "
        "never be reduced and the ranks would drift apart silently. With timm's tasks: "
        "task = AlignedClassificationTask(model, scheme); task.prepare_distributed(device_ids=[local_rank]); "
        "result = task(images, label_map). By hand: ddp = DistributedDataParallel(adapted, device_ids=[local_rank]) "
        "and call ddp(images, label_map), not the adapter (a DistributedDataParallel of the bare model does not "
        "see the adapter's forward); or FSDP2 (torch.distributed.fsdp.fully_shard): adapted = adapt(model, scheme), "
        "fully_shard each block, then fully_shard(adapted) and call adapted(images, label_map) (docs/distributed.md). "
        "FSDP1's FullyShardedDataParallel wrapper is not supported. If this forward really needs no gradient "
        "reduction (each rank trains its own model on purpose), set adapted.check_distributed = False."
    )
