"""Whether a family's real model compiles whole: a TL-Align training step under ``torch.compile(fullgraph=True)``.

The compile tests (``tests/test_compile.py``) take each family's tiny 32 px test model; this takes the model the
benchmarks time (``benchmarks/_families.py``) at its default input size, where grids are large, windows pad and
strides meet odd sizes: what the GPU suite compiles, and what a user compiles. On the CPU with dynamo's
``aot_eager`` backend (the graph traced through AOT autograd, forward and backward, and run by eager kernels: no code
generation, seconds a family), so a graph break, a recompile or a traced value that differs from eager shows here
before a GPU's time is spent on it.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any

import torch

from benchmarks._gpu_steps import dynamo_stats
from benchmarks._training_step import TrainingSteps

__all__ = ["TOLERANCE", "compiles_whole"]

SEED = 1000
"""The RNG seed of each batch's compiled and eager steps (the same seed for both: stochastic depth and dropout draw
the same masks)."""

TOLERANCE = 1e-5
"""The largest difference between the compiled and the eager step that ``compiles_whole`` calls equal: the same
kernels run (``aot_eager``), so what differs is rounding where the traced graph orders operations its own way."""


def compiles_whole(model_name: str, batch_size: int = 2, batches: int = 2) -> dict[str, Any]:
    """``batches`` TL-Align training steps (forward, loss, backward) of ``model_name`` through its adapter compiled
    with ``fullgraph=True`` (``aot_eager``, CPU), each with fresh CutMix boxes, lambdas and partners; from the second
    on, a recompile raises. Each compiled step is compared with the eager step from the same parameters, buffers and
    RNG seed (a training forward moves batch norms' running statistics, which reparameterised label kernels read).
    The gradients are compared with the eager backward of the compiled step's own targets: the targets are compared
    apart, and their rounding, carried through a random-init network's backward, would otherwise read as a gradient
    difference (rexnet_100: targets 9e-8 apart gave gradients 7.6e-5 apart, and none on the same targets).

    Returns:
        ``model``, ``graphs`` and ``graph_breaks`` (dynamo's counters), ``compile_s`` (the first step), the largest
        absolute differences over the batches of ``target``, ``logits`` and ``loss``, and ``grad`` (the largest of any
        parameter's, relative to that gradient's own largest entry, at least 1), ``whole`` (one graph, no break, no
        recompile, each difference under ``TOLERANCE``); ``error`` instead of the figures where a step failed (a
        graph break under ``fullgraph=True`` and a recompile raise).
    """
    num_classes = 10 if model_name.startswith("example:") else 1000
    setup = TrainingSteps(model_name, num_classes=num_classes, batch_size=batch_size, device="cpu",
                          variants=("tlalign",), strict=True)
    model, adapted = setup.model, setup.adapted["tlalign"]
    torch._dynamo.reset()
    compiled: Any = torch.compile(adapted, backend="aot_eager", fullgraph=True)
    row: dict[str, Any] = {"model": model_name}
    diffs = {"target": 0.0, "logits": 0.0, "loss": 0.0, "grad": 0.0}
    try:
        with dynamo_stats() as stats:
            for i in range(batches):
                mixed, label_map = setup.mixer(setup.images, setup.labels)
                state = copy.deepcopy(model.state_dict())
                t0 = time.perf_counter()
                torch.manual_seed(SEED + i)
                with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
                    got = compiled(mixed, label_map)
                    got_loss = got.loss()
                    got_loss.backward()
                if i == 0:
                    row["compile_s"] = time.perf_counter() - t0
                got_grads = _grads(model)
                model.load_state_dict(state)
                torch.manual_seed(SEED + i)
                want = adapted(mixed, label_map)
                want_loss = want.loss()
                # the backward compared on the same targets: see ``compiles_whole``
                dataclasses.replace(want, target=got.target.detach(), token_target=_detached(got.token_target)).loss().backward()
                want_grads = _grads(model)
                for name, a, b in (("target", got.target, want.target), ("logits", got.logits, want.logits),
                                   ("loss", got_loss, want_loss)):
                    diffs[name] = max(diffs[name], float((a.detach() - b.detach()).abs().max()))
                if got_grads.keys() != want_grads.keys():
                    raise RuntimeError(f"the compiled step gave gradients to {sorted(set(got_grads) ^ set(want_grads))} "
                                       "and eager's did not, or the other way round")
                for name, grad in want_grads.items():
                    scale = max(1.0, float(grad.abs().max()))
                    diffs["grad"] = max(diffs["grad"], float((got_grads[name] - grad).abs().max()) / scale)
    except Exception as err:  # a graph break (fullgraph), a recompile, a failing trace: the row says which
        row["error"] = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"
        row["whole"] = False
        return row
    row.update(stats)
    row.update(diffs)
    row["whole"] = stats["graphs"] == 1 and stats["graph_breaks"] == 0 and all(d <= TOLERANCE for d in diffs.values())
    return row


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient, taken off the model (which then holds none)."""
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads
