"""AlignedClassificationTask in timm's training machinery: DDP, compile, EMA, checkpoints, optimiser groups,
gradient accumulation, AMP, and the refusals of what cannot work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import timm
import torch
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.utils import ModelEmaV3
from torch import nn
from torch.testing import assert_close

from test_fsdp import report_of

import mixlabels
from mixlabels.backbones import FAMILIES, AlignedClassificationTask, adapt

_VIT = next(f for f in FAMILIES if f.name == "vit")  # a ViT, 32x32 images, 10 classes
from mixlabels.strategies import timm_mixup

REPO_ROOT = Path(__file__).resolve().parents[1]


def tiny() -> nn.Module:
    return _VIT.example()  # ViT, 32x32 images, 10 classes


def mixed_batch(seed: int = 0, b: int = 4) -> tuple[torch.Tensor, mixlabels.TokenLabelMap]:
    g = torch.Generator().manual_seed(seed)
    mixer = timm_mixup(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=10, generator=g)
    return mixer(torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g))  # type: ignore[no-any-return]


def train_steps(task: AlignedClassificationTask, steps: int = 2, ema: bool = False) -> None:
    opt = torch.optim.SGD(task.get_trainable_module().parameters(), lr=0.5)
    for i in range(steps):
        opt.zero_grad()
        task(*mixed_batch(i))["loss"].backward()
        opt.step()
        if ema:
            task.update_ema(step=i + 1)


# ---------------------------------------------------------------------------- distributed
def test_ddp_two_ranks_stay_identical_and_skipping_ddp_is_caught() -> None:
    report = report_of(REPO_ROOT / "tests" / "_ddp_task_worker.py")
    assert "task.prepare_distributed" in report["unprepared"]  # the task refuses to train un-reduced
    assert "DistributedDataParallel(adapted" in report["beside_ddp"]  # so does the adapter beside a DDP of the model
    assert report["start_spread"] == 0.0  # same initial weights on both ranks...
    assert report["unsynced_spread"] > 1e-3  # ...negative control: without DDP, different data drifts them apart
    assert report["losses_differ"]  # the ranks did see different batches
    assert report["synced_spread"] == 0.0  # through the task's DDP (with a no_sync accumulation step) they agree


def test_prepare_distributed_without_a_process_group_says_how() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        AlignedClassificationTask(tiny(), mixlabels.TLAlign(), verbose=False).prepare_distributed()


# ---------------------------------------------------------------------------- compile
def test_compile_traces_the_training_forward() -> None:
    traced: list[torch.fx.GraphModule] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        traced.append(gm)
        return gm.forward

    torch._dynamo.reset()
    task = AlignedClassificationTask(tiny(), mixlabels.TLAlign(), verbose=False)
    eager = task(*mixed_batch(0))["loss"]
    task.compile(backend=counting)
    out = task(*mixed_batch(0))
    assert traced, "the training forward was not compiled"
    ops = [str(n.target) for gm in traced for n in gm.graph.nodes if n.op == "call_function"]
    depth = len(task.get_eval_model()._orig_mod.blocks)
    assert any("conv2d" in op for op in ops)  # the patch embedding...
    assert sum("linear" in op for op in ops) >= 4 * depth + 1  # ...qkv, proj, fc1, fc2 of every block, the head
    assert any("autograd_function_apply" in op for op in ops)  # ...and the attention that also mixes the labels
    assert_close(out["loss"], eager)
    n_train = len(traced)
    task.get_eval_model()(torch.randn(2, 3, 32, 32))  # the eval model is compiled separately
    assert len(traced) > n_train
    torch._dynamo.reset()


# ---------------------------------------------------------------------------- EMA, checkpoints, state dicts
def test_ema_and_checkpoints_are_plain_timm_state_dicts() -> None:
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    task = AlignedClassificationTask(model, mixlabels.TLAlign(), verbose=False)
    task.setup_ema(decay=0.5)
    train_steps(task, 2, ema=True)
    state = task.get_checkpoint_state()["state_dict"]
    ema_state = task.get_checkpoint_state(ema=True)["state_dict_ema"]
    for sd in (state, ema_state):
        fresh = tiny()
        fresh.load_state_dict(sd, strict=True)  # no "model." prefixes
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    moved = [k for k in before if before[k].is_floating_point() and not torch.equal(ema_state[k], before[k])]
    assert moved and any(not torch.equal(ema_state[k], state[k]) for k in moved)  # a real average, not a copy
    task.load_checkpoint_state(before)  # resume: loads into the trained model
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_adapter_state_dict_is_the_model_s_own() -> None:
    model = tiny()
    adapted = adapt(model, mixlabels.TLAlign())
    assert list(adapted.state_dict()) == list(model.state_dict())
    fresh = tiny()
    fresh.load_state_dict(adapted.state_dict(), strict=True)
    other = adapt(tiny(), mixlabels.TLAlign())
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(1.0)
    other.load_state_dict(model.state_dict(), strict=True)  # a timm checkpoint loads into the adapter
    assert all(torch.equal(a, b) for a, b in zip(other.model.parameters(), model.parameters()))
    ema = ModelEmaV3(adapted, decay=0.9)  # an EMA of the adapter itself saves plain keys too
    tiny().load_state_dict(ema.module.state_dict(), strict=True)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        adapted.load_state_dict({**model.state_dict(), "model.extra": torch.zeros(1)}, strict=True)


def test_compiled_task_checkpoint_is_plain() -> None:
    task = AlignedClassificationTask(tiny(), mixlabels.TLAlign(), verbose=False)
    task.compile(backend="eager")
    tiny().load_state_dict(task.get_checkpoint_state()["state_dict"], strict=True)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------- optimiser groups
def _groups(opt: torch.optim.Optimizer) -> list[tuple[frozenset[int], float, float]]:
    return sorted(
        (frozenset(id(p) for p in g["params"]), g["weight_decay"], g.get("lr_scale", 1.0)) for g in opt.param_groups
    )


@pytest.mark.parametrize("layer_decay", [None, 0.75])
def test_optimizer_groups_equal_the_plain_model_s(layer_decay: float | None) -> None:
    model = tiny()
    task = AlignedClassificationTask(model, mixlabels.TLAlign(), verbose=False)
    kwargs: dict[str, Any] = dict(opt="adamw", lr=1e-3, weight_decay=0.05, layer_decay=layer_decay)
    ours = create_optimizer_v2(task.get_trainable_module(), **kwargs)
    plain = create_optimizer_v2(model, **kwargs)
    assert _groups(ours) == _groups(plain)
    no_decay = {id(p) for g in ours.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert id(model.pos_embed) in no_decay  # timm's no_weight_decay reached through the prefix


# ---------------------------------------------------------------------------- mixing off, accumulation, AMP
def test_mixup_off_trains_on_the_unmixed_smoothed_targets() -> None:
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(4, 3, 32, 32, generator=g), torch.tensor([1, 2, 3, 4])
    mixer = timm_mixup(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=10)
    mixer.mixup_enabled = False
    out_images, lm = mixer(images, labels)
    assert torch.equal(out_images, images) and lm.num_sources == 1
    model = tiny()
    result = AlignedClassificationTask(model, mixlabels.TLAlign(), verbose=False)(out_images, lm)
    expected = LabelSmoothingCrossEntropy(smoothing=0.1)(model(images), labels)  # timm's loss without mixing
    assert_close(result["loss"], expected)


def test_grad_accumulation_sums_micro_batch_gradients() -> None:
    model = tiny()
    task = AlignedClassificationTask(model, mixlabels.TLAlign(), verbose=False)
    model.eval()  # no dropout/drop-path draws: the two passes see the same network
    batches = [mixed_batch(1), mixed_batch(2)]
    separate = []
    for images, lm in batches:
        model.zero_grad()
        task(images, lm)["loss"].backward()
        separate.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
    model.zero_grad()
    for images, lm in batches:  # train.py: result["loss"] /= accum_steps, in place, then backward
        loss = task(images, lm)["loss"]
        loss /= 2
        loss.backward()
    for p, g1, g2 in zip(model.parameters(), *separate):
        assert_close(p.grad, (g1 + g2) / 2)


def test_bf16_autocast_on_cpu() -> None:
    task = AlignedClassificationTask(tiny(), mixlabels.TLAlign(), criterion=SoftTargetCrossEntropy(), verbose=False)
    images, lm = mixed_batch(3)
    full = task(images, lm)["loss"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = task(images, lm)
    assert result["output"].dtype == torch.bfloat16
    result["loss"].backward()
    assert_close(result["loss"].float(), full, atol=0.05, rtol=0.05)
    grads = [p.grad for p in task.get_eval_model().parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_token_labeling_logs_its_two_losses() -> None:
    result = AlignedClassificationTask(tiny(), mixlabels.TokenLabeling(), verbose=False)(*mixed_batch(4))
    assert set(result) == {"loss", "output", "class_loss", "token_loss"}
    assert_close(result["loss"].detach(), result["class_loss"] + 0.5 * result["token_loss"])


# ---------------------------------------------------------------------------- refusals
def test_label_tensors_are_refused_with_the_fix() -> None:
    task = AlignedClassificationTask(tiny(), mixlabels.TLAlign(), verbose=False)
    images = torch.randn(2, 3, 32, 32)
    with pytest.raises(TypeError, match=r"integer targets of shape \(2, 1\).*\(b,\) class ids"):
        task(images, torch.tensor([[1], [2]]))
    with pytest.raises(TypeError, match="timm's Mixup"):
        task(images, torch.full((2, 10), 0.1))
    ids_only = AlignedClassificationTask(tiny(), mixlabels.TLAlign(), criterion=LabelSmoothingCrossEntropy(0.1),
                                         verbose=False)
    with pytest.raises(TypeError, match=r"LabelSmoothingCrossEntropy takes class ids, but this batch was mixed.*"
                                        r"SoftTargetCrossEntropy"):
        ids_only(*mixed_batch(0))


# ---------------------------------------------------------------------------- one ported train.py, mixing on or off
def ported_train_py(model: nn.Module, mixup: float, cutmix: float, smoothing: float, steps: int = 2,
                    task_cls: Any = AlignedClassificationTask) -> list[torch.Tensor]:
    """The lines of timm's train.py that build the loss, the mixer and the task, with mixlabels' mixer and task.

    Returns the losses of ``steps`` SGD steps on fixed batches (each forward after ``torch.manual_seed(step)``).
    """
    mixup_active = mixup > 0 or cutmix > 0
    mixer = (timm_mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, label_smoothing=smoothing, num_classes=10,
                        generator=torch.Generator().manual_seed(0)) if mixup_active else None)
    if mixup_active:
        train_loss_fn: nn.Module = SoftTargetCrossEntropy()
    elif smoothing:
        train_loss_fn = LabelSmoothingCrossEntropy(smoothing=smoothing)
    else:
        train_loss_fn = nn.CrossEntropyLoss()
    if task_cls is AlignedClassificationTask:
        task = AlignedClassificationTask(model, mixlabels.TLAlign(), criterion=train_loss_fn, verbose=False)
    else:
        task = task_cls(model, criterion=train_loss_fn, verbose=False)
    opt = torch.optim.SGD(task.get_trainable_module().parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        input, target = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
        if mixer is not None:
            input, target = mixer(input, target)
        torch.manual_seed(step)  # the same drop-path draws in both tasks
        loss = task(input, target)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_a_ported_train_py_trains_without_mixing_as_timm_does(smoothing: float) -> None:
    import copy

    from timm.task import ClassificationTask

    model = tiny()
    reference = copy.deepcopy(model)
    ours = ported_train_py(model, mixup=0.0, cutmix=0.0, smoothing=smoothing)
    timm_losses = ported_train_py(reference, mixup=0.0, cutmix=0.0, smoothing=smoothing, task_cls=ClassificationTask)
    assert_close(torch.stack(ours), torch.stack(timm_losses))  # hard or smoothed targets, as timm's task trains
    assert not torch.equal(ours[0], ours[1])  # the second step saw updated weights
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(p, q)
    # the same script with mixing on: label maps, aligned targets
    mixed = ported_train_py(tiny(), mixup=0.8, cutmix=1.0, smoothing=smoothing)
    assert all(torch.isfinite(v) for v in mixed)


def test_class_ids_with_a_soft_target_criterion_train_on_one_hot_rows() -> None:
    model = tiny()
    model.eval()
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 3, 9, 3])
    for criterion in (None, SoftTargetCrossEntropy()):
        result = AlignedClassificationTask(model, mixlabels.NoAlign(), criterion=criterion, verbose=False)(images, labels)
        assert_close(result["loss"], nn.functional.cross_entropy(model(images), labels))
        assert_close(result["output"], model(images))


def test_timm_distillation_with_a_label_map_says_what_to_do() -> None:
    from timm.task import LogitDistillationTask

    task = LogitDistillationTask(tiny(), tiny(), criterion=SoftTargetCrossEntropy(), verbose=False)
    images, lm = mixed_batch(0)
    with pytest.raises(TypeError, match=r"TokenLabelMap reached a loss written for target tensors.*"
                                        r"LogitDistillationTask.*AlignedClassificationTask.*image_targets\(\)"):
        task(images, lm)
    result = task(images, lm.image_targets())  # the workaround the message names: unaligned image targets
    assert_close(result["task_loss"], SoftTargetCrossEntropy()(result["output"], lm.image_targets()))
    from timm.loss import BinaryCrossEntropy  # train.py's --bce-loss: the loss reads target.shape first

    bce = LogitDistillationTask(tiny(), tiny(), criterion=BinaryCrossEntropy(), verbose=False)
    with pytest.raises(AttributeError, match=r"TokenLabelMap has no shape: .*AlignedClassificationTask"):
        bce(images, lm)
    assert not hasattr(lm, "shape")  # duck-typing checks still see no tensor


def test_timm_create_model_is_accepted_and_eval_model_is_plain() -> None:
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                              depth=1, num_heads=2, num_classes=10)  # fmt: skip
    task = AlignedClassificationTask(model, mixlabels.NoAlign(), verbose=False)
    assert task.get_eval_model() is model and task.get_trainable_module().model is model
    assert list(task.get_clip_parameters()) == list(model.parameters())


def test_bce_criterion_sees_the_aligned_soft_targets() -> None:
    from timm.loss import BinaryCrossEntropy

    model = tiny()
    model.eval()
    task = AlignedClassificationTask(model, mixlabels.TLAlign(), criterion=BinaryCrossEntropy(), verbose=False)
    images, lm = mixed_batch(5)
    result = task(images, lm)
    out = task.get_trainable_module()(images, lm)
    assert_close(result["loss"], BinaryCrossEntropy()(out.logits, out.target))
