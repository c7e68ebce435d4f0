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
from benchmarks._config import AblationConfig

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
