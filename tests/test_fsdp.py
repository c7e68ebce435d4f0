"""FSDP2 (``fully_shard``) on 2 gloo ranks on the CPU: an adapted model trains as one process on the whole batch.

One ``torchrun`` of ``_fsdp_worker.py`` (about 50 s, some 20 of them for the per-block families) runs every
case; the tests read its report.
Rank ``r`` takes half ``r`` of a CutMix batch of 4; one process trains a copy on the whole batch.
The same launch trains DDP of the compiled adapter. A second ``torchrun`` runs docs/distributed.md's loop as
written (about 20 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_readme import python_block

from mixlabels.backbones import FAMILIES
from mixlabels.backbones._common import AdaptedBase

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = REPO_ROOT / "docs" / "distributed.md"
FP32 = 1e-5  # relative to each gradient's largest entry: float32 sums in another order
BF16 = 0.1  # bf16 compute (8 bits of mantissa) against the float32 process


def torchrun(script: Path) -> str:
    """``script``'s standard output under ``torchrun --nproc-per-node 2`` (gloo on the CPU)."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    printed = "a REPORT line" if "\nREPORT " in "\n" + proc.stdout else "no REPORT line"
    err = proc.stderr if len(proc.stderr) < 4000 else proc.stderr[:1500] + "\n[...]\n" + proc.stderr[-2500:]
    assert proc.returncode == 0, f"exit {proc.returncode}, stdout had {printed}; stderr:\n{err}"
    return proc.stdout


def report_of(script: Path) -> dict[str, Any]:
    """The JSON object rank 0 of ``script`` printed on its ``REPORT`` line (``_dist_teardown.finish``), under ``torchrun``."""
    lines = [ln for ln in torchrun(script).splitlines() if ln.startswith("REPORT ")]
    assert len(lines) == 1, f"{script.name} printed {len(lines)} REPORT lines, expected rank 0's one"
    result: dict[str, Any] = json.loads(lines[0][len("REPORT ") :])
    return result


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return report_of(REPO_ROOT / "tests" / "_fsdp_worker.py")


def test_per_block_sharding_equals_one_process_on_the_whole_batch(report: dict[str, Any]) -> None:
    run = report["vit_blocks"]
    assert run["sharded"] == ["FSDPAdaptedViT", "FSDPBlock"]  # each block, then the adapter as the root
    assert run["resharded_after_forward"]  # the blocks' hooks ran: gathered for their forward, freed after it
    assert max(run["grads"]) < FP32  # gathered gradients == one process's, at every step
    assert max(run["params"]) < FP32  # and the parameters after every SGD step
    assert run["spread"] == 0.0  # the ranks hold the same model
    assert run["losses"][0] != run["losses"][1]  # the steps saw different batches


@pytest.mark.parametrize("case", ["vit_blocks_compiled", "resnet_blocks_compiled", "vit_root_compiled"])
def test_compiled_after_sharding_equals_one_compiled_process(report: dict[str, Any], case: str) -> None:
    """``torch.compile(adapted)`` after ``fully_shard``, per block and the root alone: per block, the first compiled
    step registers each unit's hooked forward method eagerly (dynamo could not trace FSDP2's registration: an internal
    error on that step); every step's gradients and parameters equal one compiled process's."""
    run = report[case]
    assert "error" not in run, run.get("error")
    assert run["resharded_after_forward"] or case.endswith("root_compiled")  # the root alone has no units to free
    assert max(run["grads"]) < FP32 and max(run["params"]) < FP32 and run["spread"] == 0.0
    assert run["losses"][0] != run["losses"][1]


@pytest.mark.parametrize("family", ["vit", "resnet"])
def test_ddp_of_the_compiled_adapter_equals_one_compiled_process(report: dict[str, Any], family: str) -> None:
    """DDP instead of FSDP2, in the same launch: ``DistributedDataParallel(torch.compile(adapted))`` (what timm's
    ``train.py --torchcompile`` runs under ``torchrun``) trains as one compiled process on the whole batch."""
    run = report[f"{family}_ddp_compiled"]
    assert "error" not in run, run.get("error")
    assert max(run["grads"]) < FP32 and max(run["params"]) < FP32 and run["spread"] == 0.0
    assert run["losses"][0] != run["losses"][1]


def test_root_only_sharding_equals_one_process(report: dict[str, Any]) -> None:
    run = report["vit_root"]
    assert run["sharded"] == ["FSDPAdaptedViT"]
    assert max(run["grads"]) < FP32 and max(run["params"]) < FP32 and run["spread"] == 0.0


@pytest.mark.parametrize("case, sharded", [("tv_resnet_root", "FSDPAdaptedTvResNet"), ("any_root", "FSDPAdaptedClassifier")])
def test_root_only_sharding_of_a_torchvision_family_and_of_any_model(report: dict[str, Any], case: str, sharded: str) -> None:
    run = report[case]
    assert run["sharded"] == [sharded]
    assert max(run["grads"]) < FP32 and max(run["params"]) < FP32 and run["spread"] == 0.0


def test_root_only_sharding_is_right_where_fsdp2_finds_outputs_by_pytree(report: dict[str, Any]) -> None:
    """torch up to 2.11: FSDP2 hooks a sharded root's backward on the tensors ``tree_flatten`` finds in its output (2.12
    on looks into dataclasses itself; the worker patches the lookup back there). The adapter's output is a pytree node,
    so its gradients are reduced; the control, the output unregistered, shows the failure it prevents: no pre-backward
    hook, gradients never reduced, wrong by far more than rounding, and no error."""
    run, control = report["vit_root_pytree"], report["vit_root_pytree_control"]
    assert "error" not in run, run.get("error")
    assert max(run["grads"]) < FP32 and max(run["params"]) < FP32 and run["spread"] == 0.0
    assert "error" not in control, control.get("error")
    assert max(control["grads"]) > 1e-2


def test_the_adapters_output_flattens_to_its_tensors_and_back() -> None:
    """What FSDP2's ``tree_flatten`` (torch <= 2.11) and any pytree walk see of an adapter's output: every tensor field,
    and the output rebuilt as it was."""
    from torch.utils import _pytree as pytree

    import mixlabels
    from mixlabels.backbones import adapt

    model = next(f for f in FAMILIES if f.name == "vit").example()
    adapted = adapt(model, mixlabels.TokenLabeling())
    x = torch.randn(2, 3, 32, 32)
    lm = mixlabels.TokenLabelMap.from_mask(torch.ones(2, 32, 32), torch.tensor([1, 0]), torch.tensor([3, 4]), num_classes=10)
    out = adapted(x, lm)
    leaves, spec = pytree.tree_flatten(out)
    assert out.token_logits is not None and out.token_target is not None
    fields = [out.logits, out.target, out.token_logits, out.token_target]
    assert all(any(leaf is t for leaf in leaves) for t in fields)
    assert any(leaf is out.logits and leaf.requires_grad for leaf in leaves)
    back = pytree.tree_unflatten(leaves, spec)
    assert type(back) is type(out) and back.token_loss_weight == out.token_loss_weight
    assert all(getattr(back, n) is getattr(out, n) for n in ("output", "logits", "target", "weights", "token_logits", "token_target"))


def test_bf16_mixed_precision_trains_within_bf16_of_one_float32_process(report: dict[str, Any]) -> None:
    run = report["vit_bf16"]
    assert run["resharded_after_forward"]
    assert run["logits"] == "torch.bfloat16"  # the blocks computed in bf16...
    assert run["target"] == "torch.float32"  # ...the labels stayed fp32...
    assert run["param_dtype"] == "torch.float32"  # ...and the sharded parameters the optimiser steps
    assert max(run["grads"]) < BF16 and max(run["params"]) < BF16
    assert run["spread"] == 0.0


def test_cnn_family_per_block(report: dict[str, Any]) -> None:
    # BatchNorm normalises by each rank's own half: the one process runs the two halves and averages
    run = report["resnet_blocks"]
    assert run["sharded"] == ["FSDPAdaptedResNet", "FSDPBasicBlock"]
    assert run["resharded_after_forward"]
    assert max(run["grads"]) < FP32 and max(run["params"]) < FP32 and run["spread"] == 0.0


def test_every_other_family_with_units_per_block(report: dict[str, Any]) -> None:
    """One launch shards every family whose ``fsdp_units()`` is not empty (besides vit and resnet) per block: the
    gathered gradients and parameters equal one process's on the whole batch (run as the ranks' two halves, so the
    sums are the same: exact on the CPU), the blocks are freed after their forward, the ranks stay identical."""
    runs = report["families_blocks"]
    adapters = [f for f in FAMILIES if isinstance(f.build, type) and issubclass(f.build, AdaptedBase)]
    named = [f.name for f in adapters if f.build.fsdp_units is not AdaptedBase.fsdp_units]
    assert sorted(runs) == sorted(set(named) - {"vit", "resnet"})
    for name, run in runs.items():
        assert len(run["sharded"]) >= 2, (name, run["sharded"])  # the adapter and its blocks' classes
        assert run["resharded_after_forward"], name
        assert max(run["grads"]) < FP32 and max(run["params"]) < FP32, (name, run["grads"], run["params"])
        assert run["spread"] == 0.0, name
        assert run["losses"][0] != run["losses"][1], name


def test_negative_control_blocks_walked_without_their_hooks_crash(report: dict[str, Any]) -> None:
    assert "mixed torch.Tensor and DTensor" in report["refusals"]["control_no_hooks"]


def test_a_float32_output_cast_keeps_the_targets(report: dict[str, Any]) -> None:
    """``output_dtype=torch.float32`` on the root (logits up-cast for the loss) is allowed: the targets are float32."""
    assert report["refusals"]["root_output_fp32"] == "torch.float32 torch.float32"


ORDER = "adapted = adapt(model, scheme); fully_shard each of adapted.model.blocks; then fully_shard(adapted), last"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("shard_then_adapt", ["TypeError: adapt cannot adapt a model already sharded by FSDP2's fully_shard", "adapt first"]),
        ("model_as_root", ["not to the adapted module", ORDER]),
        ("inside_block", ["model.blocks.0.attn, model.blocks.1.attn, whose hooks it never runs", ORDER]),
        ("family_without_units", ["model.blocks.0", "adapted = adapt(model, scheme); fully_shard(adapted), last"]),
        ("reference", ["reference=True", "use the fast path"]),
        ("root_casts_map", ["cast_forward_inputs=False", "adapted(images.to(param_dtype), label_map)"]),
        ("root_casts_output", ["AlignedOutput.target is torch.bfloat16", "output_dtype=None (or torch.float32)"]),
        ("unsharded", ["outside DistributedDataParallel and not sharded by FSDP2", "then fully_shard(adapted)",
                       "FSDP1's FullyShardedDataParallel wrapper is not supported"]),
    ],
)  # fmt: skip
def test_what_cannot_work_refuses_with_the_order(report: dict[str, Any], case: str, expected: list[str]) -> None:
    message = report["refusals"][case]
    assert message is not None, case
    for part in expected:
        assert part in message, (part, message)


def test_the_docs_loop_trains_as_written(tmp_path: Path) -> None:
    (tmp_path / "train_fsdp.py").write_text(python_block("## The loop", DOCS.read_text()))
    losses = [float(ln.split()[-1]) for ln in torchrun(tmp_path / "train_fsdp.py").splitlines() if ln.startswith("step ")]
    assert len(losses) == 3 and all(0.0 < loss < 10.0 for loss in losses)


def test_the_docs_list_the_families_that_shard_per_block() -> None:
    """docs/distributed.md's list is the families whose adapter overrides ``fsdp_units``."""
    listed = DOCS.read_text().split("<!-- fsdp-units -->")[1].split("<!-- /fsdp-units -->")[0]
    adapters = [(f.name, f.build) for f in FAMILIES if isinstance(f.build, type) and issubclass(f.build, AdaptedBase)]
    per_block = [name for name, cls in adapters if cls.fsdp_units is not AdaptedBase.fsdp_units]
    assert listed.split(", ") == per_block
