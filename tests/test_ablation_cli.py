"""The ablation's command line is derived from ``AblationConfig``: every flag it had stays, with its meaning."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from benchmarks import ablation
from benchmarks._ablation_cli import Flag, _argument, build_parser, config_flags
from benchmarks._ablation_config import AblationConfig

ROOT = Path(__file__).resolve().parents[1]

# The command line as it was hand-kept before it was derived: flag, a value to give it, the field it sets and
# the value that field then holds. Every one must keep its name and meaning.
BEFORE: list[tuple[str, list[str], tuple[str, ...], Any]] = [
    ("--table", ["8"], ("table",), 8),
    ("--rows", ["none,cutmix"], ("rows",), ("none", "cutmix")),
    ("--seeds", ["0-2,7"], ("seeds",), (0, 1, 2, 7)),
    ("--data", ["/some/folder.tar"], ("data", "source"), "/some/folder.tar"),
    ("--data-root", ["/x/data"], ("data_root",), "/x/data"),
    ("--loader", ["folder"], ("data", "loader"), "folder"),
    ("--img-size", ["48"], ("data", "img_size"), 48),
    ("--subset", ["all"], ("data", "subset"), None),
    ("--test-subset", ["123"], ("data", "test_subset"), 123),
    ("--model", ["vit_tiny_patch16_224"], ("model", "name"), "vit_tiny_patch16_224"),
    ("--patch-size", ["8"], ("model", "patch_size"), 8),
    ("--embed-dim", ["96"], ("model", "embed_dim"), 96),
    ("--depth", ["3"], ("model", "depth"), 3),
    ("--heads", ["4"], ("model", "num_heads"), 4),
    ("--drop-path", ["0.25"], ("model", "drop_path"), 0.25),
    ("--init", ["base.pth"], ("model", "init"), "base.pth"),
    ("--pretrained", [], ("model", "pretrained"), True),
    ("--epochs", ["0.5"], ("recipe", "epochs"), 0.5),
    ("--max-steps", ["7"], ("recipe", "max_steps"), 7),
    ("--batch-size", ["32"], ("recipe", "batch_size"), 32),
    ("--lr", ["0.002"], ("recipe", "lr"), 0.002),
    ("--weight-decay", ["0.1"], ("recipe", "weight_decay"), 0.1),
    ("--warmup", ["0.1"], ("recipe", "warmup"), 0.1),
    ("--device", ["cuda:1"], ("device",), "cuda:1"),
    ("--bf16", [], ("bf16",), True),
    ("--no-bf16", [], ("bf16",), False),
    ("--out", ["/tmp/out"], ("out",), "/tmp/out"),
    ("--cache-dir", ["/tmp/cache"], ("cache_dir",), "/tmp/cache"),
    ("--download", [], ("download",), True),
    ("--no-download", [], ("download",), False),
    ("--workers", ["2"], ("workers",), 2),
    ("--threads", ["3"], ("threads",), 3),
    ("--eval-batch-size", ["100"], ("eval_batch_size",), 100),
    ("--quiet", [], ("quiet",), True),
    ("--save-checkpoints", [], ("save_checkpoints",), True),
    ("--teacher-epochs", ["3"], ("teacher_epochs",), 3.0),
    ("--profile", ["finetune"], ("profile",), "finetune"),
    ("--base-data", ["cifar10"], ("base_data",), "cifar10"),
    ("--base-epochs", ["5"], ("base_epochs",), 5.0),
]


def _field(cfg: AblationConfig, path: tuple[str, ...]) -> Any:
    value: Any = cfg
    for name in path:
        value = getattr(value, name)
    return value


@pytest.mark.parametrize(("flag", "args", "path", "expected"), BEFORE, ids=[b[0] for b in BEFORE])
def test_every_old_flag_sets_its_field(flag: str, args: list[str], path: tuple[str, ...], expected: Any) -> None:
    cfg, dry = ablation.resolve_config([flag, *args])
    assert not dry
    assert _field(cfg, path) == expected
    if flag != "--download":  # on by default: --no-download is the case that shows it works
        assert _field(AblationConfig(), path) != expected, f"{flag} is tested at its default: pick another value"


def test_every_old_flag_is_derived_from_its_field() -> None:
    derived = {flag.name: flag.path for flag, _ in config_flags()}
    for flag, _, path, _ in BEFORE:
        name = flag.replace("--no-", "--")
        assert derived.get(name) == path, f"{name} no longer sets {'.'.join(path)}"


def test_every_field_is_a_flag_but_the_models_image_size() -> None:
    derived = {flag.path for flag, _ in config_flags()}
    expected: set[tuple[str, ...]] = set()
    for name, info in AblationConfig.model_fields.items():
        if name in ("data", "model", "recipe"):
            section = info.annotation
            assert isinstance(section, type) and issubclass(section, BaseModel)
            expected |= {(name, sub) for sub in section.model_fields}
        else:
            expected.add((name,))
    assert derived == expected - {("model", "img_size")}


def test_help_lists_every_flag_with_its_description() -> None:
    out = subprocess.run([sys.executable, "benchmarks/ablation.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout

    def squash(text: str) -> str:  # argparse wraps lines, also at hyphens
        return re.sub(r"\s+", "", text)

    text = squash(out)
    for flag, _ in config_flags():
        info: Any = AblationConfig.model_fields[flag.path[0]]
        if len(flag.path) == 2:
            info = info.annotation.model_fields[flag.path[1]]
        assert info.description, f"{'.'.join(flag.path)} has no description: its flag {flag.name} has no help"
        assert flag.name in out
        assert squash(info.description) in text, f"--help lacks {flag.name}'s description"
    for name, _, _, _ in BEFORE:
        assert name in out


def test_literal_flags_parse_to_their_values_and_name_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert ablation.resolve_config(["--table", "7"])[0].table == 7
    assert ablation.resolve_config(["--table", "tokenlabel"])[0].table == "tokenlabel"
    with pytest.raises(SystemExit):
        ablation.resolve_config(["--table", "9"])
    assert "--table takes 7, 8 or tokenlabel, got '9'" in capsys.readouterr().err


def test_flags_override_the_config_file_and_the_preset(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"recipe": {"lr": 0.01, "batch_size": 16}, "data": {"source": "imagenette"}}')
    cfg, dry = ablation.resolve_config(["--config", str(path), "--lr", "0.02", "--dry-run", "--mean", "0.5,0.5,0.5"])
    assert dry
    assert cfg.recipe.lr == 0.02 and cfg.recipe.batch_size == 16  # the flag over the file, the file over the preset
    assert cfg.data.img_size == 224 and cfg.model.img_size == 224  # imagenette's preset, the model follows the data
    assert cfg.data.mean == (0.5, 0.5, 0.5)


def test_a_field_of_a_type_the_command_line_cannot_parse_is_named() -> None:
    flag = Flag(("recipe", "schedule"), "--schedule", "")
    with pytest.raises(TypeError, match=r"recipe\.schedule has type .*_NO_FLAG"):
        _argument(flag, dict[str, int])


def test_parser_has_no_flag_twice() -> None:
    names = [a for action in build_parser()._actions for a in action.option_strings]
    assert len(names) == len(set(names))


# ------------------------------------------------------------------ data sets: presets, sizes, dry runs (issue 29)
def _folder(root: Path, classes: int = 3, per_class: int = 4) -> Path:
    """A tiny ImageFolder tree: ``train`` and ``val`` with ``classes`` folders of ``per_class`` 8x8 PNGs each."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


# the CIFAR-sized recipe kept on a folder data set: a 1-block, 16-wide DeiT on 16 px images, one optimizer step
KEEP = ["--loader", "tensor", "--img-size", "16", "--model", "deit_tiny_patch16_224", "--patch-size", "4",
        "--embed-dim", "16", "--depth", "1", "--heads", "2", "--batch-size", "4", "--max-steps", "1",
        "--eval-batch-size", "8", "--threads", "1", "--quiet"]


def test_auto_augment_none_is_unset_like_every_other_none() -> None:
    from benchmarks._ablation_config import DataConfig, ModelConfig, RecipeConfig, RunConfig, run_key

    for text in ("none", "None", "NONE"):
        cfg, _ = ablation.resolve_config(["--auto-augment", text])
        assert cfg.data.auto_augment is None
    assert ablation.resolve_config(["--auto-augment", "rand-m9"])[0].data.auto_augment == "rand-m9"
    # the same run, the same key: a finished run is not trained again because of the spelling
    run = RunConfig(data=DataConfig(), model=ModelConfig(), recipe=RecipeConfig())
    spelled = run.model_copy(update={"data": DataConfig.model_validate({"auto_augment": "none"})})
    assert spelled.data.auto_augment is None and run_key(spelled) == run_key(run)


def test_help_says_what_a_data_set_changes_and_how_to_keep_the_recipe() -> None:
    out = subprocess.run([sys.executable, "benchmarks/ablation.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    text = re.sub(r"\s+", " ", out)
    assert "Any other data set (--data imagenette, or a PATH) switches to an ImageNet-like recipe" in text
    for words in ("--model deit_small_patch16_224", "--patch-size none", "--epochs 100.0", "--batch-size 256",
                  "--loader folder", "--auto-augment rand-m9-mstd0.5-inc1", "--mean 0.485,0.456,0.406",
                  "keeps its own setting over the preset", "--base-data defaults to imagenette for a cifar10 job "
                  "and to cifar10 for any other"):
        assert words in text, words
    assert "any data set but cifar10 switches the recipe" in text  # on --data itself


def test_a_data_set_that_switches_the_recipe_says_so_and_the_named_flags_keep_it() -> None:
    from benchmarks._ablation_cli import resolve

    cfg, _, note = resolve(["--data", "/some/folder", "--img-size", "32"])
    assert note is not None and cfg.model.name == "deit_small_patch16_224"
    assert "--data /some/folder switches the recipe" in note and "--epochs 100.0" in note
    assert "a 2x2 token grid at --img-size 32" in note  # the patch-16 model on 32 px images
    assert "--img-size" not in note.split("switches")[1].split("To keep")[0]  # given, so not the preset's
    keep = note.split("add: ")[1].split(";")[0].split()
    kept, _, again = resolve(["--data", "/some/folder", "--img-size", "32", *keep])
    assert again is None  # nothing left for the preset to change
    default = AblationConfig()
    assert kept.data == default.data.model_copy(update={"source": "/some/folder"})
    assert (kept.model, kept.recipe) == (default.model, default.recipe)
    assert resolve([])[2] is None and resolve(["--data", "cifar10"])[2] is None
    _, _, fine = resolve(["--data", "imagenette", "--profile", "finetune", *keep])
    assert fine is not None and "the base model trains on cifar10" in fine and "--base-data" in fine


def test_the_recipe_switch_is_printed_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _folder(tmp_path / "ds")
    assert ablation.main(["--data", str(data), "--img-size", "16", "--rows", "none", "--seeds", "0", "--dry-run",
                          "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out"), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert out.index(f"ablation: --data {data} switches the recipe") < out.index("resolved config")


def test_a_subset_beyond_the_data_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _folder(tmp_path / "ds")  # 12 training and 12 evaluation images
    common = ["--data", str(data), *KEEP, "--rows", "none", "--seeds", "0", "--cache-dir", str(tmp_path / "cache"),
              "--out", str(tmp_path / "out")]
    for extra, words in ((["--subset", "100000000"], "--subset 100000000 asks for more training images than"),
                         (["--test-subset", "13"], "--test-subset 13 asks for more evaluation images than")):
        for dry in (["--dry-run"], []):  # the dry run refuses what the real run refuses, before any training
            assert ablation.main([*common, *extra, *dry]) == 2
            err = capsys.readouterr().err
            assert words in err and f"{data} has (12)" in err and "all for every image" in err, err
            assert not (tmp_path / "out" / "runs").exists()
    cfg, _ = ablation.resolve_config([*common, "--subset", "12", "--test-subset", "all"])  # all of it is fine
    from benchmarks._ablation_data import load_data
    from benchmarks._data import Shard

    loaded = load_data(cfg, Shard(0, 1, torch_device("cpu")))
    assert loaded.num_classes == 3 and loaded.train_indices is not None and len(loaded.train_indices) == 12


def torch_device(name: str) -> Any:
    import torch

    return torch.device(name)


def test_a_dry_run_on_a_folder_plans_the_keys_a_run_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _folder(tmp_path / "ds")
    argv = ["--data", str(data), *KEEP, "--rows", "none,cutmix", "--seeds", "0", "--subset", "all",
            "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out")]
    cfg, _ = ablation.resolve_config([*argv, "--dry-run"])
    plan = ablation.run_ablation(cfg, dry_run=True)
    assert (plan.trained, plan.skipped) == (0, 0)
    listed = set(re.findall(r"^  ([0-9a-f]{16})  ", capsys.readouterr().out, re.M))
    ran = ablation.run_ablation(ablation.resolve_config(argv)[0])
    assert ran.trained == 3 and all(r["run"]["mixer"] is None or r["run"]["mixer"]["num_classes"] == 3
                                     for r in ran.records)
    written = {p.stem for p in (tmp_path / "out" / "runs").glob("*.json")}
    assert listed == written and len(written) == 3  # the dry run planned the 3-class keys, not 1000-class ones
    again = ablation.run_ablation(cfg, dry_run=True)
    assert (again.trained, again.skipped) == (0, 3)
    assert "3 runs (3 already done, 0 to train)" in capsys.readouterr().out


def test_finetune_dry_run_refuses_what_the_run_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks._archive import NAMED, default_data_root

    if not (default_data_root() / NAMED["cifar10"]).is_file():
        pytest.skip("the CIFAR-10 archive is not in ../shared/data")
    common = ["--profile", "finetune", "--dry-run", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "o"),
              "--threads", "1"]
    assert ablation.main([*common, "--base-data", str(tmp_path / "nonexistent")]) == 2
    err = capsys.readouterr().err
    assert f"no data at {tmp_path / 'nonexistent'}" in err and "--data takes" in err
    folder = _folder(tmp_path / "ds")  # 3 classes, CIFAR-10 has 10: the cells could not load the base's head
    assert ablation.main([*common, "--base-data", str(folder)]) == 2
    assert "has 3 classes and the job's cifar10 10" in capsys.readouterr().err
