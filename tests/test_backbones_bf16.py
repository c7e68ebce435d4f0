"""Every aligning family under a bf16 autocast on the CPU, as a CUDA bf16 training step runs it.

Autocast runs matmul, einsum and bmm in bf16 wherever it is on. The label path must not let it in: a label product
in bf16 rounds the labels to 3 digits, and fp32 labels meeting bf16 ones make ``lerp`` refuse the pair (the bug
this file was written for: a stem's window weights came out bf16, and 24 families' CUDA bf16 steps raised; the
families without a ``lerp`` rounded their labels quietly). The CUDA twin (``test_backbones_cuda``) needs a GPU;
this one needs none. A tracker wrapper checks what the ``LabelTracker`` protocol promises: every label tensor
handed to or taken from the model's label path is fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from test_backbones_common import B, IMG, C, WrappedScheme, cutmix_batch
from test_backbones_cuda import ALIGNING, _frozen_statistics, _model
from torch import Tensor
from torch.testing import assert_close

from mixlabels import TLAlign, TokenLabeling, backbones
from mixlabels._align import Fork, LabelTracker
from mixlabels._routes import launch_routes
from mixlabels.backbones._common import label_kernels


def _fp32(what: str, t: Tensor | None, seen: list[str]) -> None:
    if t is not None:
        assert t.dtype == torch.float32, f"{what} is {t.dtype} under a bf16 autocast; labels stay fp32"
        seen.append(what)


class _Checked:
    """A tracker that checks the dtype of every label tensor crossing the protocol, then delegates."""

    def __init__(self, tracker: LabelTracker, seen: list[str]) -> None:
        self._t, self._seen = tracker, seen

    def labels_for(self, layer: int) -> Tensor | None:
        y = self._t.labels_for(layer)
        _fp32("labels_for", y, self._seen)
        return y

    def residual(self, layer: int, keep: Tensor | None, *, mixed: Tensor | None) -> None:
        _fp32("a residual's mixed labels", mixed, self._seen)
        self._t.residual(layer, keep, mixed=mixed)

    def _checked(self, what: str, merge: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        def run(y: Tensor) -> Tensor:
            _fp32(f"{what}'s input", y, self._seen)
            out = merge(y)
            _fp32(f"{what}'s output", out, self._seen)
            return out

        return run

    def aggregate(self, merge: Callable[[Tensor], Tensor], *, normalised: bool = False) -> None:
        self._t.aggregate(self._checked("aggregate", merge), normalised=normalised)

    def fork(self) -> Fork:
        fork = self._t.fork()
        _fp32("a fork's labels", fork.labels, self._seen)
        return fork

    def join(
        self, fork: Fork, share: float, *, merge: Callable[[Tensor], Tensor] | None = None, keep: Tensor | None = None,
        normalised: bool = False,
    ) -> None:
        self._t.join(fork, share, merge=None if merge is None else self._checked("join", merge), keep=keep, normalised=normalised)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


def check_bf16_step(family: backbones.Family, device: str) -> None:
    """TL-Align in train mode on ``device`` under its bf16 autocast: labels fp32 at every event, targets fp32 rows
    summing to 1 and close to the fp32 step's (bf16 attention weights: about 3 digits), and the loss trains."""
    model = _model(family).to(device).train()
    images, lm = cutmix_batch()
    images, lm = images.to(device), lm.to(device)
    seen: list[str] = []
    adapted = backbones.adapt(model, WrappedScheme(TLAlign(), lambda t: _Checked(t, seen)))
    torch.manual_seed(5)
    full = adapted(images, lm).target
    torch.manual_seed(5)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = adapted(images, lm)
        loss = out.loss()
    assert seen, f"{family.name}: the tracker saw no label tensor, so the checks above checked nothing"
    assert out.target.dtype == torch.float32 and not out.target.requires_grad
    assert_close(out.target.sum(-1), torch.ones(B, device=device))
    assert_close(out.target, full, rtol=0, atol=3e-2)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("family", ALIGNING, ids=lambda f: f.name)
@pytest.mark.parametrize("route", ["cpu", "launch"])
def test_bf16_autocast_keeps_every_label_fp32(family: backbones.Family, route: str) -> None:
    """On the CPU's eager route and on the GPU's (``launch_routes``: what a CUDA step runs; there the readout of
    attention-mixed labels was not renormalised, and their rows summed to 1 only within bf16's rounding, up to
    1.3e-3 off)."""
    with launch_routes() if route == "launch" else nullcontext():
        check_bf16_step(family, "cpu")


@pytest.mark.parametrize("family", ALIGNING, ids=lambda f: f.name)
def test_the_gpus_routes_give_the_cpus_targets_under_autocast(family: backbones.Family) -> None:
    """Train mode (stochastic depth drawn alike, statistics frozen), bf16 autocast: the GPU's routes (``launch_routes``,
    a cold step and a warm one) give the CPU's targets to fp32's rounding (all 74 within 2.4e-7 here), where MobileViT's
    aggregations skipped their renormalisation after bf16 label channels (1.5e-4) and attention families' readouts
    theirs (twins 6.8e-4)."""
    model = _frozen_statistics(_model(family).train())
    images, lm = cutmix_batch()
    adapted = backbones.adapt(model, TLAlign())

    def targets() -> Tensor:
        torch.manual_seed(3)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return adapted(images, lm).target

    want = targets()
    with launch_routes():
        for _ in range(2):
            assert_close(targets(), want, rtol=0, atol=1e-6, msg=f"{family.name}: the GPU's routes under autocast")


# Families whose labels read the weights alone, never an activation (no attention, no token mixing by the data): under
# autocast their targets are their fp32 targets on every route, to fp32's rounding
WEIGHTS_ONLY = ["convnext", "cspnet", "densenet", "efficientnet", "fasternet", "ghostnet", "hgnet", "inception_next",
                "mobilenetv3", "regnet", "repvit", "res2net", "resnest", "resnet", "resnetv2", "rexnet", "selecsls",
                "senet", "starnet", "tresnet", "vgg", "vovnet", "xception_aligned", "tv_resnet", "tv_efficientnet"]


@pytest.mark.parametrize("name", WEIGHTS_ONLY)
def test_labels_read_from_weights_do_not_follow_autocast(name: str) -> None:
    """The label kernels of a forward's convs, read together on the GPU's routes (``Kernels``) outside any tracker
    event, came out of ``addmm`` in bf16 under autocast (InceptionNeXt's targets moved 3e-5): the targets under a
    bf16 autocast equal the fp32 ones, on the CPU's route and on the GPU's, cold and warm (grid plans)."""
    family = next(f for f in ALIGNING if f.name == name)
    model = family.example().eval()
    images, lm = cutmix_batch()
    adapted = backbones.adapt(model, TLAlign())
    with torch.no_grad():
        for route in (nullcontext(), launch_routes(), launch_routes()):
            with route:
                want = adapted(images, lm).target
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    got = adapted(images, lm).target
            assert got.dtype == torch.float32
            assert_close(got, want, rtol=0, atol=1e-6, msg=f"{name}: its labels followed the autocast")


def test_label_kernels_read_together_stay_fp32_under_autocast() -> None:
    """``label_kernels`` of weights of several shapes (the product route of their means), called outside any fp32
    region under a bf16 autocast, as ``Kernels`` calls it: fp32, and the values without autocast."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, 3, 3, generator=g) for o, i in [(8, 1), (16, 1), (8, 1), (24, 1)]]
    with launch_routes():
        want = label_kernels(weights)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = label_kernels(weights)
    for k, w in zip(got, want, strict=True):
        assert k.dtype == torch.float32
        assert_close(k, w, rtol=0, atol=1e-7)


@pytest.mark.parametrize("family", ALIGNING, ids=lambda f: f.name)
def test_bf16_autocast_token_targets_stay_fp32(family: backbones.Family) -> None:
    """Aligned token labeling (annotator maps mixed on the patch grid, then aligned) under the same autocast."""
    model = _model(family).eval()
    images, lm = cutmix_batch()
    lm = lm.with_token_targets(torch.rand(B, IMG, IMG, C, generator=torch.Generator().manual_seed(3)).softmax(-1))
    seen: list[str] = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = backbones.adapt(model, WrappedScheme(TokenLabeling(beta=0.5, aligned=True), lambda t: _Checked(t, seen)))(images, lm)
    assert seen, f"{family.name}: the tracker saw no label tensor"
    assert out.target.dtype == torch.float32
    assert out.token_target is None or out.token_target.dtype == torch.float32
