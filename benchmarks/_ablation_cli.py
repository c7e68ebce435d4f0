"""The ablation's command line, derived from ``AblationConfig``'s fields.

Every field of ``AblationConfig`` and of its ``data``, ``model`` and ``recipe`` sections
is a flag: the field name with dashes (``recipe.batch_size`` is ``--batch-size``), its
type parsed from the text, its ``description`` as the help. A field added to the config
is on the command line without touching this file; a field whose type this file cannot
parse fails ``build_parser`` with its name. The few flags named otherwise than their
field keep their names (``_RENAMED``); ``model.img_size`` has no flag: the model is built
for ``--img-size``, the images it gets.
"""

from __future__ import annotations

import argparse
import json
import re
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from benchmarks._ablation_config import AblationConfig
from benchmarks._rows import EXTENSION_ROWS, ROW_IDS

__all__ = ["Flag", "config_flags", "build_parser", "resolve_config", "resolve", "load_config_file"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_SIZE_FIELDS = ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio")

# Per-dataset defaults, below a config file and the flags. CIFAR-10's are the AblationConfig defaults;
# Imagenette (or any other ImageFolder) is the paper's setting: DeiT at 224 px through timm's transforms.
_IMAGENET_LIKE: dict[str, Any] = {
    "data": {
        "loader": "folder",
        "img_size": 224,
        "mean": IMAGENET_MEAN,
        "std": IMAGENET_STD,
        "auto_augment": "rand-m9-mstd0.5-inc1",
        "subset": None,
        "test_subset": None,
    },
    "model": {"name": "deit_small_patch16_224", **{k: None for k in _SIZE_FIELDS}},
    "recipe": {"epochs": 100.0, "batch_size": 256, "lr": 1e-3, "warmup": 0.05},
}

# The sections whose fields are flags too (without the section's name: --batch-size, not --recipe-batch-size).
_SECTIONS = ("data", "model", "recipe")
# Flags named otherwise than their field: the names the command line had before it was derived.
_RENAMED: dict[tuple[str, ...], str] = {("data", "source"): "--data", ("model", "name"): "--model",
                                        ("model", "num_heads"): "--heads"}
# Fields with no flag: the model is built for the images it gets (``resolve_config`` sets it from --img-size).
_NO_FLAG: frozenset[tuple[str, ...]] = frozenset({("model", "img_size")})
# What the command line adds to a field's description.
_NOTES: dict[tuple[str, ...], str] = {
    ("rows",): f"; comma separated: table 7 {','.join(ROW_IDS[7])} (beyond the paper: {','.join(EXTENSION_ROWS[7])}); "
               f"table 8 {','.join(ROW_IDS[8])}; tokenlabel {','.join(ROW_IDS['tokenlabel'])}",
    ("seeds",): "; comma separated, ranges inclusive: 0,1 or 0-9 or 0-4,7 (default 0,1)",
    ("model", "name"): " (pretrained=False); a new name drops the CIFAR size overrides",
    ("data", "source"): "; any data set but cifar10 switches the recipe (see the end of --help)",
}


class Flag(typing.NamedTuple):
    """One command-line flag: the config field it sets (``("recipe", "lr")``), its name and help."""

    path: tuple[str, ...]
    name: str
    help: str


def config_flags() -> Iterator[tuple[Flag, Any]]:
    """Every flag ``AblationConfig`` yields, with its field's annotation (``Annotated`` metadata stripped)."""
    for name, info in AblationConfig.model_fields.items():
        if name in _SECTIONS:
            section = info.annotation
            assert isinstance(section, type) and issubclass(section, BaseModel)
            fields: list[tuple[tuple[str, ...], FieldInfo]] = [((name, sub), sub_info)
                                                              for sub, sub_info in section.model_fields.items()]
        else:
            fields = [((name,), info)]
        for path, field in fields:
            if path in _NO_FLAG:
                continue
            flag = _RENAMED.get(path, "--" + path[-1].replace("_", "-"))
            yield Flag(path, flag, (field.description or "") + _NOTES.get(path, "")), field.annotation


def build_parser() -> argparse.ArgumentParser:
    """The command line; every flag defaults to "not given" so that a config file's values survive."""
    p = argparse.ArgumentParser(
        prog="python benchmarks/ablation.py",
        description="Train and evaluate the paper's Table 7 (mixers x TL-Align) or Table 8 (TL-Align operations). "
        "Every AblationConfig field is a flag; --config takes them all as a file.",
        argument_default=argparse.SUPPRESS,
        epilog=_preset_help(),
    )
    p.add_argument("--config", type=Path, help="AblationConfig as .json or .yaml; flags override it")
    seen: dict[str, tuple[str, ...]] = {}
    for flag, annotation in config_flags():
        if flag.name in seen:
            raise TypeError(f"config fields {'.'.join(seen[flag.name])} and {'.'.join(flag.path)} both make the flag "
                            f"{flag.name}: name one of them in _RENAMED or _NO_FLAG")
        seen[flag.name] = flag.path
        argument = _argument(flag, annotation)
        note = argument.pop("help_note", "")
        if "action" not in argument and "choices" not in argument:
            argument.setdefault("metavar", flag.name[2:].upper().replace("-", "_"))
        # argparse %-formats help texts
        p.add_argument(flag.name, dest=".".join(flag.path), help=(flag.help + note).replace("%", "%%"), **argument)
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and the runs, train nothing")
    return p


def _preset_help() -> str:
    """What a data set other than cifar10 changes, from ``_IMAGENET_LIKE`` (so the help cannot drift from it)."""
    names = {flag.path: flag.name for flag, _ in config_flags()}
    sets = []
    for section, fields in _IMAGENET_LIKE.items():
        for field, value in fields.items():
            if (section, field) in names:
                sets.append(f"{names[section, field]} {_text(value)}")
    return ("Data sets and recipes: the defaults above are the CIFAR-10 recipe (--data cifar10). Any other data set "
            "(--data imagenette, or a PATH) switches to an ImageNet-like recipe, DeiT at 224 px through timm's "
            f"transforms: {', '.join(sets)}. A flag or a --config value keeps its own setting over the preset, and a "
            "line at start names what the preset changed with the flags that keep the CIFAR-10 recipe. Under "
            "--profile finetune, --base-data defaults to imagenette for a cifar10 job and to cifar10 for any other "
            "data set.").replace("%", "%%")


def _argument(flag: Flag, annotation: Any) -> dict[str, Any]:
    """``add_argument``'s type/action/choices for a field of this annotation."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else ()
    optional = type(None) in options
    inner = next(a for a in options if a is not type(None)) if optional and len(options) == 2 else annotation
    if inner is bool:
        # False by default: a switch; True or None by default: --x / --no-x
        default: Any = AblationConfig().model_dump()
        for part in flag.path:
            default = default[part]
        return {"action": "store_true"} if default is False and not optional else {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(inner) is Literal:
        values = typing.get_args(inner)
        if all(isinstance(v, str) for v in values):
            return {"choices": values}
        return {"type": _literal(flag.name, values), "metavar": "{" + ",".join(map(str, values)) + "}"}
    if typing.get_origin(inner) is tuple:
        item = typing.get_args(inner)[0]
        parse: dict[Any, Callable[[str], list[Any]]] = {int: _int_list, str: _csv_list, float: _float_list}
        if item in parse:
            return {"type": parse[item]}
    if inner in (int, float):
        # None from the text only for numbers: "all"/"none" is never a number, but it may be a path or a name
        return {"type": _optional(inner), "help_note": " ('all' or 'none': unset)"} if optional else {"type": inner}
    if inner is str:
        return {"type": str}
    raise TypeError(f"config field {'.'.join(flag.path)} has type {annotation!r}, which the ablation's command line "
                    "cannot parse: add it to benchmarks/_ablation_cli._argument, or to _NO_FLAG (config file only)")


def _csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _float_list(text: str) -> list[float]:
    try:
        return [float(t) for t in _csv_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma separated numbers (0.5,0.5,0.5), got {text!r}") from None


def _int_list(text: str) -> list[int]:
    """``"0,1"`` or ``"0-9"`` (inclusive) or a mix: ``"0-2,7"`` is ``[0, 1, 2, 7]``."""
    out: list[int] = []
    for part in _csv_list(text):
        first, dash, last = part.partition("-") if not part.startswith("-") else ("", "", "")
        try:
            if dash:
                lo, hi = int(first), int(last)
                if hi < lo:
                    raise argparse.ArgumentTypeError(f"seed range {part!r} runs backwards; write {hi}-{lo}")
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma separated integers or inclusive ranges (0,1 or 0-9), got {text!r}") from None
    return out


def _literal(flag: str, values: Sequence[Any]) -> Callable[[str], Any]:
    """A parser to the literal whose text is given: ``--table 7`` is the int 7, ``--table tokenlabel`` the str."""

    def parse(text: str) -> Any:
        for value in values:
            if text == str(value):
                return value
        raise argparse.ArgumentTypeError(f"{flag} takes {', '.join(map(str, values[:-1]))} or {values[-1]}, got {text!r}")

    return parse


def _optional(kind: type[int] | type[float]) -> Callable[[str], int | float | None]:
    """A number, or None from ``all``/``none`` (``--subset all``: every image)."""

    def parse(text: str) -> int | float | None:
        return None if text.lower() in ("all", "none") else kind(text)

    parse.__name__ = kind.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


def load_config_file(path: Path) -> dict[str, Any]:
    """The mapping in a ``.json`` or ``.yaml``/``.yml`` file."""
    if not path.is_file():
        raise FileNotFoundError(f"no config file at {path}")
    text = path.read_text()
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            loaded: Any = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path} is not valid YAML: {e}") from e
    elif path.suffix.lower() == ".json":
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from e
    else:
        raise ValueError(f"config file {path} must end in .json, .yaml or .yml")
    if not isinstance(loaded, dict):
        raise ValueError(f"config file {path} must hold a mapping of AblationConfig fields, got {type(loaded).__name__}")
    return loaded


def _flags_to_tree(flags: dict[str, Any]) -> dict[str, Any]:
    """The given flags as a nested AblationConfig mapping (each flag's dest is its field's dotted path)."""
    tree: dict[str, Any] = {}
    for dest, value in flags.items():
        if dest in ("config", "dry_run"):
            continue
        *sections, field = dest.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[field] = value
    return tree


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_config(argv: Sequence[str] | None = None) -> tuple[AblationConfig, bool]:
    """The job's config from defaults < the data set's preset < ``--config`` file < flags; and ``--dry-run``."""
    cfg, dry_run, _ = resolve(argv)
    return cfg, dry_run


def resolve(argv: Sequence[str] | None = None) -> tuple[AblationConfig, bool, str | None]:
    """``resolve_config``, plus the line that says what the data set's preset changed (None: nothing)."""
    args = vars(build_parser().parse_args(argv))
    given = load_config_file(args["config"]) if "config" in args else {}
    given = _merge(given, _flags_to_tree(args))
    source = str(given.get("data", {}).get("source", "cifar10"))
    preset: dict[str, Any] = {} if source == "cifar10" else _IMAGENET_LIKE
    model = given.get("model", {})
    if "name" in model and model["name"] != preset.get("model", {}).get("name", AblationConfig().model.name):
        # another architecture: the CIFAR width/depth/patch overrides would silently shrink it
        preset = _merge(preset, {"model": {k: None for k in _SIZE_FIELDS}})
    tree = _merge(preset, given)
    if "img_size" not in model:  # unless asked otherwise, the model is built for the images it gets
        img = tree.get("data", {}).get("img_size", AblationConfig().data.img_size)
        tree = _merge(tree, {"model": {"img_size": img}})
    cfg = AblationConfig.model_validate(tree)
    return cfg, bool(args.get("dry_run", False)), _preset_note(cfg, source, preset, given)


def _preset_note(cfg: AblationConfig, source: str, preset: dict[str, Any], given: dict[str, Any]) -> str | None:
    """What the data set's preset changed (the fields neither a flag nor the config file set) and how to keep it."""
    default = AblationConfig()
    changed: list[tuple[Flag, Any, Any]] = []  # flag, the value now, the default recipe's value
    for flag, _ in config_flags():
        if not _has(preset, flag.path) or _has(given, flag.path):
            continue
        now, before = _get(cfg, flag.path), _get(default, flag.path)
        if now != before:
            changed.append((flag, now, before))
    notes: list[str] = []
    if changed:
        what = ", ".join(f"{flag.name} {_text(now)}" for flag, now, _ in changed)
        keep = " ".join(f"{flag.name} {_text(before)}" for flag, _, before in changed)
        notes.append(f"--data {source} switches the recipe to the ImageNet-like preset: {what}. "
                     f"To keep the CIFAR-10 recipe, add: {keep}")
        patch = re.search(r"patch(\d+)", cfg.model.name)
        if cfg.model.patch_size is None and patch is not None:
            side = cfg.data.img_size // int(patch.group(1))
            notes.append(f"{cfg.model.name} keeps timm's patch size {patch.group(1)}: a {side}x{side} token grid "
                         f"at --img-size {cfg.data.img_size}")
    if cfg.profile == "finetune" and cfg.base_data is None and source != "cifar10":
        notes.append(f"under --profile finetune the base model trains on {cfg.base_source()} (--base-data's default "
                     "for a data set other than cifar10), not on imagenette: pass --base-data to choose")
    return "; ".join(notes) if notes else None


def _has(tree: dict[str, Any], path: tuple[str, ...]) -> bool:
    node: Any = tree
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _get(cfg: AblationConfig, path: tuple[str, ...]) -> Any:
    value: Any = cfg
    for part in path:
        value = getattr(value, part)
    return value


def _text(value: Any) -> str:
    """A value as its flag takes it: ``none`` for None, comma separated tuples."""
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)
