"""Fine-tuning entry points: --init checkpoints in every format timm users have, clear refusals, --pretrained offline."""

from __future__ import annotations

import argparse
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.testing import assert_close

from benchmarks import _init, ablation
from benchmarks._archive import NAMED, default_data_root
from benchmarks._ablation_config import ModelConfig, keyed_dump
from benchmarks._init import PretrainedUnavailable, load_init, read_state_dict

TINY = dict(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2)
CIFAR = default_data_root() / NAMED["cifar10"]
TINY_RUN = ["--subset", "64", "--test-subset", "64", "--batch-size", "16", "--max-steps", "2", "--eval-batch-size", "64",
            "--embed-dim", "16", "--depth", "2", "--heads", "2", "--quiet", "--threads", "1"]


def tiny(seed: int, **overrides: Any) -> ModelConfig:
    torch.manual_seed(seed)
    return ModelConfig(**{**TINY, **overrides})


def tiny_init(seed: int) -> dict[str, torch.Tensor]:
    """The seed's own initialisation of the test's run model (what a cell would start from without the base)."""
    torch.manual_seed(seed)
    return ModelConfig(img_size=32, patch_size=4, embed_dim=16, depth=2, num_heads=2).build(10).state_dict()


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("wrap", ["raw", "state_dict", "model", "state_dict_ema", "timm_train", "ddp", "safetensors"])
def test_init_formats_load_exactly(tmp_path: Path, wrap: str) -> None:
    source = tiny(0).build(10)
    state = params(source)
    path = tmp_path / ("w.safetensors" if wrap == "safetensors" else "w.pth")
    if wrap == "safetensors":
        save_file(state, str(path))
    else:
        blob: Any = {
            "raw": state,
            "state_dict": {"state_dict": state, "epoch": 3},
            "model": {"model": state},
            "state_dict_ema": {"state_dict_ema": state},
            # as timm's train.py saves: its args namespace, and the EMA beside the weights (the weights win)
            "timm_train": {"epoch": 3, "arch": "deit_tiny_patch16_224", "state_dict": state, "version": 2,
                           "args": argparse.Namespace(lr=1e-3, model="deit_tiny_patch16_224"), "metric": 50.0,
                           "state_dict_ema": {k: torch.zeros_like(v) for k, v in state.items()}},
            "ddp": {f"module.{k}": v for k, v in state.items()},
        }[wrap]
        torch.save(blob, path)
    cfg = tiny(1, init=str(path))
    fresh = cfg.build(10)
    assert any((fresh.state_dict()[k] - v).abs().max() > 0 for k, v in state.items())  # a random init differs
    model = cfg.initialised(10)
    for k, v in model.state_dict().items():
        assert_close(v, state[k], rtol=0, atol=0, msg=k)


def test_init_refusals_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--init .*no such file"):
        read_state_dict(tmp_path / "nope.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="could not be read"):
        read_state_dict(tmp_path / "junk.pth")
    torch.save({"epoch": 3, "note": "no weights"}, tmp_path / "meta.pth")
    with pytest.raises(ValueError, match="holds no state dict.*'epoch'"):
        read_state_dict(tmp_path / "meta.pth")
    torch.save(tiny(0, depth=2).build(10).state_dict(), tmp_path / "deep.pth")
    with pytest.raises(ValueError, match=r"does not fit .*unexpected 1\d \(blocks\.1\."):
        load_init(tiny(0).build(10), tmp_path / "deep.pth")
    torch.save(tiny(0).build(100).state_dict(), tmp_path / "c100.pth")
    with pytest.raises(ValueError, match=r"shape mismatches .* 2 \(head\.weight \(100, 16\) vs \(10, 16\)"):
        load_init(tiny(0).build(10), tmp_path / "c100.pth")
    with pytest.raises(ValueError, match="not both"):
        ModelConfig(init=str(tmp_path / "deep.pth"), pretrained=True)


class TouchedNetwork(BaseException):
    """Not an Exception: no ``except Exception`` on the way can turn it into the error under test."""


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Any connection attempt fails the test; an empty hub cache."""
    import huggingface_hub.constants

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise TouchedNetwork("the test touched the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.mark.parametrize("how", ["env", "unreachable"])
def test_pretrained_offline_fails_fast_and_clearly(no_network: None, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    import huggingface_hub.constants

    if how == "env":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the probe must not even run
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(_init, "hub_reachable", lambda: False)
    cfg = ModelConfig(name="deit_tiny_patch16_224", img_size=None, patch_size=None, embed_dim=None, depth=None,
                      num_heads=None, pretrained=True)
    start = time.monotonic()
    with pytest.raises(PretrainedUnavailable, match="not in the local cache.*--init PATH"):
        cfg.initialised(10)
    assert time.monotonic() - start < 60  # no retry loop or network wait (a generous bound, not a timing test)
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False or how == "env"  # the switch is put back


def test_init_enters_the_run_key_by_content(tmp_path: Path) -> None:
    ckpt = tmp_path / "base.pth"
    argv = ["--rows", "cutmix", "--seeds", "0", "--embed-dim", "16", "--depth", "2", "--heads", "2"]
    cfg, _ = ablation.resolve_config(argv)
    torch.save(cfg.model.build(10).state_dict(), ckpt)
    plain = ablation.plan(cfg, 10, "cpu")
    init_cfg, _ = ablation.resolve_config([*argv, "--init", str(ckpt)])
    first = ablation.plan(init_cfg, 10, "cpu")
    assert first[0].run.init_sha256 is not None and first[0].run.model.init == str(ckpt)
    assert {p.key for p in first}.isdisjoint(p.key for p in plain)  # never mixed up with runs from scratch
    torch.save(init_cfg.model.build(10).state_dict(), ckpt)  # another checkpoint at the same path
    second = ablation.plan(init_cfg, 10, "cpu")
    assert {p.key for p in second}.isdisjoint(p.key for p in first)
    with pytest.raises(FileNotFoundError, match="--init"):
        ablation.plan(ablation.resolve_config([*argv, "--init", str(tmp_path / "missing.pth")])[0], 10, "cpu")


def test_run_files_from_before_the_new_fields_still_resume(tmp_path: Path) -> None:
    cfg, _ = ablation.resolve_config(["--table", "8", "--rows", "tl-align", "--seeds", "0", "--embed-dim", "16",
                                      "--depth", "2", "--heads", "2"])
    (planned,) = ablation.plan(cfg, 10, "cpu")
    old = planned.run.model_dump(mode="json")
    del old["scheme"]["drop_path"], old["model"]["init"], old["model"]["pretrained"], old["init_sha256"], old["base"]
    assert keyed_dump(planned.run) == old
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / f"{planned.key}.json").write_text(json.dumps({"key": planned.key, "run": old, "result": {"top1": 50.0, "steps": 10}}))
    assert planned.key in ablation._read_done(tmp_path / "runs", [planned])
    other = json.loads(json.dumps(old))
    other["scheme"]["drop_path"] = "official"  # a file of another run is not taken for this one
    (tmp_path / "runs" / f"{planned.key}.json").write_text(json.dumps({"key": planned.key, "run": other, "result": {"top1": 50.0, "steps": 10}}))
    assert planned.key not in ablation._read_done(tmp_path / "runs", [planned])


@pytest.mark.skipif(not CIFAR.is_file(), reason=f"the CIFAR-10 archive is not at {CIFAR} (../shared/data)")
def test_finetune_profile_trains_the_base_once_and_starts_every_cell_from_it(tmp_path: Path) -> None:
    """Tiny sizes, base on CIFAR-10 too (no second archive to decode). With lr 1e-9 a fine-tuned cell ends
    where the base ended, not at its own seed's initialisation (the base is seed 0, the cell seed 1)."""
    out = tmp_path / "out"
    argv = ["--profile", "finetune", "--base-data", "cifar10", "--base-epochs", "1", "--rows", "cutmix", "--seeds",
            "1", "--out", str(out), "--save-checkpoints", *TINY_RUN]
    cfg, _ = ablation.resolve_config([*argv, "--lr", "1e-9", "--warmup", "0"])
    first = ablation.run_ablation(cfg)
    assert (first.trained, first.skipped) == (2, 0)
    (base_ckpt,) = (out / "base").glob("*.pth")
    base_key = base_ckpt.stem
    assert (out / "runs" / f"{base_key}.json").is_file()
    assert all(r["run"]["base"] == base_key for r in first.records)
    assert "Fine-tuned from one base model" in first.markdown
    base_state = torch.load(base_ckpt, weights_only=True)
    for rec in first.records:
        tuned = torch.load(out / "checkpoints" / f"{rec['key']}.pth", weights_only=True)
        for k, v in base_state.items():
            assert_close(tuned[k], v, rtol=0, atol=1e-3, msg=k)
        assert any((own - base_state[k]).abs().max() > 1e-2 for k, own in tiny_init(seed=1).items() if own.ndim > 1)
    scratch_cfg, _ = ablation.resolve_config([*argv[6:], "--lr", "1e-9", "--warmup", "0"])  # no profile
    scratch = ablation.plan(scratch_cfg, 10, "cpu")
    assert {p.key for p in scratch}.isdisjoint(r["key"] for r in first.records)
    # rerun: the base and the cells are reused
    base_mtime = base_ckpt.stat().st_mtime_ns
    again = ablation.run_ablation(cfg)
    assert (again.trained, again.skipped) == (0, 2) and base_ckpt.stat().st_mtime_ns == base_mtime
