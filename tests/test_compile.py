"""Every aligning family's TL-Align training step compiles whole, once, and computes what eager computes.

A user compiles the adapted model (timm's ``--torchcompile``: ``torch.compile(model)``) and
trains on batches from a mixer. For every family's registry model this file checks:

- ``fullgraph=True``: the forward (mixing labels included) and the loss trace as one graph, no
  break (a data-dependent shape or an untraceable call fails here);
- one compile serves every block and every batch: further batches with other boxes, other
  lambdas, other partners run under ``fail_on_recompile`` (block indices and layer sets are
  constants of the trace, not guards);
- compiled == eager: logits, targets, the loss and every parameter gradient: dynamo's trace, and
  ``aot_eager`` (forward and backward traced as inductor traces them, run by the same ATen ops, so
  the comparison is tight), and inductor itself (codegen reorders float sums; on the GPU,
  ``tests/test_compile_cuda.py``). The default run takes a family of each kind of label path
  (``KINDS``), the ``slow`` run every family (``pytest -m slow tests/test_compile.py``);
- the route CUDA takes under ``torch.compile`` (``separate``: two plain SDPA calls) traces whole too;
- compiling warns about none of the label path's code (dynamo warned once per ``functools.lru_cache`` it met:
  ``mixlabels._shape_cache``);
- under CPU bf16 autocast the compiled targets stay fp32 and equal eager's;
- a smaller last batch (a loader without ``drop_last``) compiles once more, with the batch size symbolic, and that
  graph serves every other size, equal to eager; ``dynamic=True`` compiles whole too, once for every size;
- a mixer of two kinds (timm's ``--mixup`` with ``--cutmix``, batch mode) compiles once per kind, then serves both;
- in a fresh process the first step's compile serves the next steps (einops' per-type backend store, which dynamo
  guards, no longer grows while the first step is traced).

The autocast, batch-size and fresh-process tests take ConvNeXt with 3x3 kernels (``LIGHT``: its 7x7 label convs'
shifted sums are most of its trace); the one-graph test traces the 7x7 example.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import warnings
from typing import Any, Literal

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import mixlabels
from mixlabels import TLAlign, backbones, strategies
from mixlabels.backbones import FAMILIES
from mixlabels.backbones._attention import attention_route
from mixlabels.backbones._family import tiny
from mixlabels.strategies import CutMix

B, IMG, C = 4, 32, 10
PACKAGE = os.path.dirname(os.path.abspath(mixlabels.__file__))  # the backbones' symlink path lies inside it too
ALIGNING = [f for f in FAMILIES if f.name != "any"]


def batches(n: int, device: str = "cpu", sizes: tuple[int, ...] = (B,)) -> list[tuple[torch.Tensor, Any]]:
    """``n`` CutMix batches with fresh boxes, lambdas and partners (what a training loop feeds), of ``sizes`` in turn."""
    gen = torch.Generator().manual_seed(0)
    mixer = CutMix(C, alpha=1.0, label_smoothing=0.1)
    out = []
    for i in range(n):
        size = sizes[i % len(sizes)]
        images = torch.randn(size, 3, IMG, IMG, generator=gen).to(device)
        labels = torch.randint(0, C, (size,), generator=gen).to(device)
        params = mixer.sample(images.shape, generator=gen, device=device)
        out.append(mixer.mix(images, labels, params))
    return out


def step(adapted: nn.Module, images: torch.Tensor, label_map: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """One forward, loss and backward; the output and the parameters' gradients. The buffers (BatchNorm's
    running statistics, which some label kernels read) are put back after, so both sides see the same."""
    model: nn.Module = adapted.model  # type: ignore[assignment]
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # the same stochastic-depth draws on both sides
    out = adapted(images, label_map)
    out.loss().backward()
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_compiles_whole(family: Any, backend: str, tol: float, device: str = "cpu", route: str | None = None,
                         mode: str | None = None) -> None:
    if route is not None:
        with attention_route(route):  # type: ignore[arg-type]
            return check_compiles_whole(family, backend, tol, device, mode=mode)
    torch._dynamo.reset()
    model = family.example().to(device).train()
    adapted = backbones.adapt(model, TLAlign())
    compiled = torch.compile(adapted, backend=backend, fullgraph=True, mode=mode)
    first, *others = batches(2, device)
    want, want_grads = step(adapted, *first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, got_grads = step(compiled, *first)  # type: ignore[arg-type]
    ours = [str(w.message) for w in caught if PACKAGE in str(w.message) or w.filename.startswith(PACKAGE)]
    assert not ours, f"compiling warned about the label path's code: {ours}"  # dynamo's lru_cache warning did
    assert_close(got.logits, want.logits, atol=tol, rtol=tol)
    assert_close(got.target, want.target, atol=tol, rtol=tol)
    assert_close(got.loss(), want.loss(), atol=tol, rtol=tol)
    assert want_grads and got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        # to the gradient's own scale: the compiled label convs round as they fuse (targets within 1e-7), and a
        # random-init example's gradients reach 1e4 (MobileNetV4's layer scales), where that is 1e-3 absolute
        scale = max(1.0, float(grad.abs().max()))
        assert_close(got_grads[name], grad, atol=tol * scale, rtol=tol, msg=lambda m: f"{name}: {m}")
    with torch.compiler.set_stance("fail_on_recompile"):  # other boxes, lambdas, partners: no new trace
        for images, label_map in others:
            again, _ = step(compiled, images, label_map)  # type: ignore[arg-type]
            assert_close(again.target, step(adapted, images, label_map)[0].target, atol=tol, rtol=tol)


# One family of each kind of label path runs in the default suite (dynamo's trace costs 3-15 s a family on 2 cores);
# every family runs in the slow suite (``pytest -m slow tests/test_compile.py``): fused attention with a class token,
# shifted windows with a mask and merging, convolutions on tap matrices with BatchNorm, depthwise convs on a large
# grid, spatial reduction, grid attention with a bias, linear attention, MobileViT's unfold attention, talking heads,
# a token-mixing MLP, outlook attention, pooling.
KINDS = ["vit", "swin", "resnet", "convnext", "pvt_v2", "maxxvit", "efficientvit_mit", "byobnet", "cait", "mlp_mixer",
         "volo", "metaformer"]


def _every(kinds: list[str], light: bool = False) -> list[Any]:
    """Every family, those outside ``kinds`` marked slow; ``light``: ConvNeXt's example with 3x3 kernels (``LIGHT``)."""
    return [pytest.param(LIGHT.get(f.name, f) if light else f, id=f.name, marks=() if f.name in kinds else pytest.mark.slow)
            for f in ALIGNING]


LIGHT_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "convnext": ("convnext_atto", {"depths": (1, 1, 1, 1), "dims": (8, 16, 24, 32), "kernel_sizes": 3}),
}
LIGHT = {f.name: dataclasses.replace(f, example=tiny(LIGHT_MODELS[f.name][0], **LIGHT_MODELS[f.name][1]))
         for f in ALIGNING if f.name in LIGHT_MODELS}
"""ConvNeXt's example with 3x3 depthwise convs, for the tests whose subject is not its kernel (autocast, other batch
sizes, ``dynamic=True``, a fresh process): its 7x7 label convs, traced as 49-tap shifted sums, are most of its graph
(1536 of 1865 nodes) and of its trace time; a 3x3's 9 taps run the same code. The one-graph test and
``test_shifted`` trace the 7x7 example itself."""


_FRESH = """
import torch
import mixlabels
from mixlabels import backbones
from mixlabels.backbones._family import tiny
from mixlabels.strategies import CutMix

torch.manual_seed(0)
light = {light!r}  # LIGHT_MODELS' entry: the timm name and its arguments
model = (tiny(light[0], **light[1])() if light else next(f for f in backbones.FAMILIES if f.name == {name!r}).example()).train()
compiled = torch.compile(backbones.adapt(model, mixlabels.TLAlign()), backend="eager", fullgraph=True)
mixer = CutMix(10)
for step in range(3):  # the first step compiles; the others, other boxes, must not trace again
    with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
        compiled(*mixer(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))).loss().backward()
"""


@pytest.mark.parametrize("name", ["convnext"])  # it rearranges a parameter (its layer scale)
def test_a_fresh_process_compiles_its_first_step_once(name: str) -> None:
    """No eager step first (the other tests' eager step warmed every cache a trace reads): what a user's script does."""
    script = textwrap.dedent(_FRESH.format(name=name, light=LIGHT_MODELS.get(name)))  # see LIGHT
    run = subprocess.run([sys.executable, "-c", script], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


AOT_KINDS = ["vit", "swin", "resnet"]
"""The kinds whose AOT test (``test_aot_traces_forward_and_backward_and_equals_eager``) runs in the default suite: it
makes dynamo's same whole-graph trace and the same checks before AOT autograd traces the backward, so their dynamo-only
test runs in the slow suite alone."""


@pytest.mark.parametrize("family", _every([k for k in KINDS if k not in AOT_KINDS]))
def test_training_step_compiles_as_one_graph_once_and_equals_eager(family: Any) -> None:
    check_compiles_whole(family, "eager", tol=1e-5)  # dynamo's trace: the whole forward and loss


def check_other_batch_sizes(family: Any, backend: str, tol: float, dynamic: bool | None = None) -> None:
    """A loader without ``drop_last`` (torchvision's reference scripts) ends each epoch on a smaller batch. Dynamo
    then compiles once more, with the batch size symbolic, and that graph must serve every other size: the label path
    may not specialise on the batch (an ``int`` of it that guards, a shape-keyed cache read in the trace).
    ``dynamic=True``: every size symbolic from the first trace (the grids' sizes too, which the label path
    specialises: constants of the trace), whole all the same, and its first graph serves every size: no batch of 4
    first there, which duck sizing would tie to the boxes' 4 coordinates (a guard no real batch size meets)."""
    torch._dynamo.reset()
    adapted = backbones.adapt(family.example().train(), TLAlign())
    compiled = torch.compile(adapted, backend=backend, fullgraph=True, dynamic=dynamic)
    # the full batch, the last one (compiled again), then sizes the symbolic graph serves; dynamic: every size at once
    sizes, compiles = ((5, 3, 2, B), 1) if dynamic else ((B, 3, 2, 5, B), 2)
    for i, (images, label_map) in enumerate(batches(len(sizes), sizes=sizes)):
        with torch.compiler.set_stance("fail_on_recompile" if i >= compiles else "default"):
            got, got_grads = step(compiled, images, label_map)  # type: ignore[arg-type]
        want, want_grads = step(adapted, images, label_map)
        assert_close(got.target, want.target, atol=tol, rtol=tol, msg=lambda m: f"batch of {sizes[i]}: {m}")
        assert_close(got.loss(), want.loss(), atol=tol, rtol=tol, msg=lambda m: f"batch of {sizes[i]}: {m}")
        assert got_grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            # see check_compiles_whole; 3x: a gradient that vanishes in exact arithmetic (MobileNetV4's dw_start
            # BatchNorm bias: a conv and a training-mode BatchNorm follow it, which remove any constant per channel)
            # is a cancelling sum of terms of the gradient flowing in, and rounds on their scale: 1.3e-5 measured
            # (its eager value 6e-6, every other gradient within 2e-7) on batches of 3 and 4
            scale = 3 * max(1.0, float(grad.abs().max()))
            assert_close(got_grads[name], grad, atol=tol * scale, rtol=tol, msg=lambda m: f"batch of {sizes[i]}, {name}: {m}")


@pytest.mark.parametrize("mode", ["batch", "elem"])
@pytest.mark.parametrize("family", _every(["vit", "resnet"], light=True))
def test_a_mixer_of_two_kinds_compiles_once_per_kind_and_equals_eager(family: Any, mode: str) -> None:
    """timm's ``--mixup`` with ``--cutmix``, as the ported ``train.py`` builds it (``timm_mixup``): in ``batch`` mode a
    batch is MixUp's or CutMix's, whose label maps carry masks of two types (dynamo guards on the type), so the step
    compiles once per kind the mixer has drawn and then serves both with no further compile (``elem`` mode: one kind
    of map, one compile); compiled == eager throughout. Seen through timm's own ``train.py`` ported, with
    ``--torchcompile``: two training graphs and the validation model's, no graph break."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    adapted = backbones.adapt(family.example().train(), TLAlign())
    compiled = torch.compile(adapted, backend="eager", fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    mixer = strategies.timm_mixup(mixup_alpha=0.8, cutmix_alpha=1.0, mode=mode, num_classes=C, generator=gen)
    kinds: set[type] = set()
    for i in range(10):
        images, label_map = mixer(torch.randn(B, 3, IMG, IMG, generator=gen), torch.randint(0, C, (B,), generator=gen))
        kinds.add(type(label_map.mask))
        # from the seventh batch on no compile may happen: every kind the mixer draws was drawn by then (asserted below)
        stance: Literal["default", "fail_on_recompile"] = "fail_on_recompile" if i >= 6 else "default"
        with torch.compiler.set_stance(stance):
            got, _ = step(compiled, images, label_map)  # type: ignore[arg-type]
        assert_close(got.target, step(adapted, images, label_map)[0].target, atol=1e-6, rtol=1e-6)
        if i == 5:
            assert len(kinds) == (2 if mode == "batch" else 1), kinds
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == len(kinds)


@pytest.mark.parametrize("family", _every(["vit", "resnet", "convnext"], light=True))
def test_a_smaller_last_batch_compiles_once_more_and_serves_every_size(family: Any) -> None:
    check_other_batch_sizes(family, "eager", tol=1e-5)


@pytest.mark.parametrize("family", _every(["vit", "convnext", "swin"], light=True))
def test_dynamic_true_compiles_whole_and_equals_eager(family: Any) -> None:
    """``torch.compile(dynamic=True)``: sizes arrive symbolic, the mask's grid and the token grid among them (a graph
    break at ``math.lcm`` of them in 23 families, before ``_mask._lcm``)."""
    check_other_batch_sizes(family, "eager", tol=1e-5, dynamic=True)


@pytest.mark.parametrize("family", _every(["vit", "resnet", "convnext"], light=True))
def test_compiled_under_bf16_autocast_keeps_fp32_labels_and_equals_eager(family: Any) -> None:
    """timm's ``--amp --amp-dtype bfloat16`` with ``--torchcompile``: the label path turns autocast off inside the
    graph as it does eagerly (``fp32_labels``), so the targets stay fp32 and equal eager's under the same autocast."""
    torch._dynamo.reset()
    adapted = backbones.adapt(family.example().train(), TLAlign())
    compiled = torch.compile(adapted, backend="aot_eager", fullgraph=True)
    for images, label_map in batches(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, _ = step(compiled, images, label_map)  # type: ignore[arg-type]
            want, _ = step(adapted, images, label_map)
        assert got.target.dtype == torch.float32
        assert_close(got.target, want.target, atol=1e-6, rtol=1e-6)
        assert_close(got.loss(), want.loss(), atol=1e-2, rtol=1e-2)  # bf16 logits: the graph may fuse their casts


@pytest.mark.parametrize("family", _every(AOT_KINDS))
def test_aot_traces_forward_and_backward_and_equals_eager(family: Any) -> None:
    """AOT autograd's trace of forward and backward, what inductor compiles (all 38: 13 minutes on 2 cores)."""
    check_compiles_whole(family, "aot_eager", tol=1e-5)


@pytest.mark.parametrize("name", ["vit", pytest.param("resnet", marks=pytest.mark.slow)])
def test_inductor_training_step_equals_eager(name: str) -> None:
    import torch._inductor.config as inductor_config

    family = next(f for f in ALIGNING if f.name == name)
    with inductor_config.patch(fallback_random=True):  # eager's RNG for dropout and drop path
        check_compiles_whole(family, "inductor", tol=1e-4)


@pytest.mark.parametrize("name", ["vit", "swin"])  # without and with an attention mask
def test_the_compiled_cuda_route_traces_whole_and_equals_eager(name: str) -> None:
    family = next(f for f in ALIGNING if f.name == name)
    check_compiles_whole(family, "aot_eager", tol=1e-5, route="separate")


# Blocks that a family carries but its registry example does not build (the example is one configuration): MixNet's
# mixed kernels and efficientnet_x's space-to-depth, ViT's parallel and post-norm blocks, the byobnet block kinds.
# Each builder is the family test's own tiny model, so what compiles here is what those tests check eager.
VARIANTS = {
    "efficientnet-mixnet": ("efficientnet", "test_backbones_efficientnet", "make_mixnet", ()),
    "efficientnet-space_to_depth": ("efficientnet", "test_backbones_efficientnet", "make_x", ()),
    "vit-parallel_things": ("vit", "test_backbones_vit", "make_model", ("parallel_things",)),
    "vit-parallel_scaling": ("vit", "test_backbones_vit", "make_model", ("parallel_scaling",)),
    "vit-res_post": ("vit", "test_backbones_vit", "make_model", ("res_post",)),
    "byobnet-genet": ("byobnet", "test_backbones_byobnet", "tiny_genet", ()),
    "byobnet-edge": ("byobnet", "test_backbones_byobnet", "tiny_edge", ()),
    "byobnet-repvgg": ("byobnet", "test_backbones_byobnet", "tiny_repvgg", ()),
    "byobnet-mobileone": ("byobnet", "test_backbones_byobnet", "tiny_mobileone", ()),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_block_variants_compile_as_one_graph_once_and_equal_eager(variant: str) -> None:
    import dataclasses
    import functools
    import importlib

    family_name, module, builder, args = VARIANTS[variant]
    family = next(f for f in ALIGNING if f.name == family_name)
    make = functools.partial(getattr(importlib.import_module(module), builder), *args)
    check_compiles_whole(dataclasses.replace(family, example=make), "eager", tol=1e-5)
