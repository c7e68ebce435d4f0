"""The paper's Table 7 (mixers x TL-Align) and Table 8 (TL-Align operations) on real data.

Run from the repository root::

    python benchmarks/ablation.py                       # Table 7, CIFAR-10, CPU, about 20 minutes
    python benchmarks/ablation.py --table 8             # Table 8's rows
    python benchmarks/ablation.py --data imagenette --model deit_small_patch16_224 --device cuda --epochs 100
    torchrun --nproc-per-node 8 benchmarks/ablation.py --data imagenette --device cuda ...   # DDP
    python benchmarks/ablation.py --init base.pth       # fine-tune every cell from a checkpoint
    python benchmarks/ablation.py --profile finetune --seeds 0-9   # base model on Imagenette at 32 px, once,
                                                        # then every cell fine-tuned from it on CIFAR-10

Data: ``--data cifar10`` (the default) reads the bundled ``cifar10-jpg.tar.gz`` from
``--data-root`` (default ``<project>/../shared/data``); without it, CIFAR-10 in
torchvision's format from ``<cache>/torchvision``, which torchvision downloads there
once (announced first; ``--no-download`` forbids it). Runs on those files keep apart
from the archive's (``<out>`` ends in ``cifar10-torchvision``; their records say so).

Every cell of the table is trained and evaluated once per seed. Each finished
run is written at once to ``<out>/runs/<run_key>.json`` (the key hashes the
run's whole configuration), so a rerun skips what is done and an interrupted job
loses at most the run in progress. At the end the table is printed in the
paper's shape and written as ``table.md``, ``runs.csv``, ``deltas.csv`` (every
delta: the mean paired per-seed difference, its 95% t interval, the seeds where
it was positive, and "no significant difference" where the interval spans 0),
``results.json`` (the resolved config, every run and every delta) and ``table.png``.

Default sizing (CIFAR-10 on 2 CPU cores, about 20 minutes for Table 7's 9 cells x 2 seeds):

    model   deit_tiny_patch16_224 through timm at 32 px, patch 4 (an 8x8 grid + class token),
            width 64, depth 6, 2 heads: 0.3 M parameters
    data    a fixed random 7,500-image training subset, a fixed 2,000-image test subset;
            random crop (pad 4) + flip + random erasing 0.25 on uint8 tensors decoded once
    recipe  DeiT's: AdamW lr 1e-3 at batch 64, wd 0.05, cosine with 5% warmup, label
            smoothing 0.1, stochastic depth 0.1; 2 epochs = 234 steps of 64 per run
    seeds   0 and 1: 9 cells x 2 seeds = 18 runs

    Measured on this 2-core machine, one training step of batch 64 (forward, backward,
    AdamW; CutMix and TL-Align included) took 0.17-0.19 s with 2 torch threads while the
    cores were nearly idle (TL-Align within the noise of the plain step), and 0.4-0.9 s
    with 1 thread while three other jobs shared the cores; evaluating 2,000 images takes
    2-5 s. Planning at a conservative 0.25 s per step:
        18 runs x (234 steps x 0.25 s + 3 s eval) = 18 x 61.5 s = 18.5 min,
    plus about 15 s of start-up and, on the very first run only, about 25 s to decode
    the archive into the cache. On idle cores it takes about 14 min; on cores shared with
    other jobs it takes longer (about 3x at the contention measured above), and the run
    files make an interrupted job resumable. In shortened trial runs, no mixing reached
    23.7% top-1 after 30 steps of 128 and CutMix 21.9% after 120 steps of 64, so the full
    runs land well above chance (10%); the spread over seeds is printed next to every mean, and every
    delta carries its paired 95% interval (``--seeds 0-9`` for ten seeds; with two, t(0.975, 1) = 12.7
    makes the interval wide).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # ``python benchmarks/ablation.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import Tensor

from benchmarks._archive import (
    NAMED,
    REPO_ROOT,
    cache_root,
    default_data_root,
    eval_split,
    extract,
    resolve_source,
    tensor_cache,
    train_split,
)
from benchmarks._archive import TensorSplit
from benchmarks._cifar_batches import TorchvisionCIFAR10, ensure_files, read_split
from benchmarks._config import AblationConfig, AnnotatorConfig, RunConfig, keyed_dump, run_key
from benchmarks._init import PretrainedUnavailable, file_digest
from benchmarks._data import Batches, FolderBatches, Shard, TensorBatches, subset_indices
from benchmarks._dist import barrier, broadcast_from_zero, setup, teardown
from benchmarks._provenance import finish, provenance
from benchmarks._rows import EXTENSION_ROWS, ROW_IDS, Cell, MixerFlags, row_ids, table_cells
from benchmarks._stats import NO_DIFFERENCE, PairedDelta, paired_delta
from benchmarks._token_labels import TokenLabelSource, annotate_split
from mixlabels import NoAlignConfig, TokenLabelingConfig
from mixlabels.score_maps import ScoreMaps
from mixlabels.strategies import CutMixConfig

__all__ = ["main", "resolve_config", "plan", "run_ablation", "Planned", "Report", "summarise", "render_markdown"]

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


# ----------------------------------------------------------------------------------------------- config


def build_parser() -> argparse.ArgumentParser:
    """The command line; every flag defaults to "not given" so that a config file's values survive."""
    p = argparse.ArgumentParser(
        prog="python benchmarks/ablation.py",
        description="Train and evaluate the paper's Table 7 (mixers x TL-Align) or Table 8 (TL-Align operations).",
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", type=Path, help="AblationConfig as .json or .yaml; flags override it")
    p.add_argument("--table", type=_table, help="7 (mixers x TL-Align, the default), 8 (TL-Align operations) or "
                   "tokenlabel (Token Labeling's CutMix / MixToken / annotator rows; trains a teacher first)")
    p.add_argument("--rows", type=_csv_list, help=f"only these rows, comma separated: table 7 {','.join(ROW_IDS[7])} "
                   f"(beyond the paper: {','.join(EXTENSION_ROWS[7])}); "
                   f"table 8 {','.join(ROW_IDS[8])}; tokenlabel {','.join(ROW_IDS['tokenlabel'])}")
    p.add_argument("--seeds", type=_int_list, help="seeds, comma separated, ranges inclusive: 0,1 or 0-9 or 0-4,7 "
                   "(default 0,1)")
    p.add_argument("--data", help="cifar10, imagenette, or a path to an ImageFolder directory or .tar/.tar.gz")
    p.add_argument("--data-root", help="directory holding the named archives (default <project>/../shared/data)")
    p.add_argument("--loader", choices=("tensor", "folder"), help="tensor: decode once, augment batches; folder: DataLoader")
    p.add_argument("--img-size", type=int, help="image side in pixels")
    p.add_argument("--subset", type=_optional_int, help="train on this many images (fixed subset); 'all' for all")
    p.add_argument("--test-subset", type=_optional_int, help="evaluate on this many images; 'all' for all")
    p.add_argument("--model", help="timm model name (pretrained=False); a new name drops the CIFAR size overrides")
    p.add_argument("--patch-size", type=int)
    p.add_argument("--embed-dim", type=int)
    p.add_argument("--depth", type=int)
    p.add_argument("--heads", type=int, dest="num_heads")
    p.add_argument("--drop-path", type=float)
    p.add_argument("--init", help="fine-tune from this state dict or timm checkpoint (.pth/.safetensors; {'state_dict': "
                   "...}, {'model': ...} or {'state_dict_ema': ...} as timm's train.py writes), loaded strictly")
    p.add_argument("--pretrained", action="store_true", help="fine-tune from timm's hub weights for --model (needs "
                   "network or the local hub cache; use a --model name without size overrides)")
    p.add_argument("--epochs", type=float, help="passes over the training (sub)set")
    p.add_argument("--max-steps", type=int, help="cap every run at this many optimizer steps")
    p.add_argument("--batch-size", type=int, help="global batch size, split over the ranks")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--weight-decay", type=float)
    p.add_argument("--warmup", type=float, help="fraction of the steps in linear warmup")
    p.add_argument("--device", help="cpu, cuda or cuda:N")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, help="bf16 autocast (default: on for cuda)")
    p.add_argument("--out", help="output directory (default runs/ablation/table<N>-<data>-<model>)")
    p.add_argument("--cache-dir", help="data cache (default $MIXLABELS_CACHE or ~/.cache/mixlabels)")
    p.add_argument("--download", action=argparse.BooleanOptionalAction,
                   help="cifar10 without the bundled archive: let torchvision download CIFAR-10 into the cache "
                   "(default: yes)")
    p.add_argument("--workers", type=int, help="folder loader: DataLoader workers per rank")
    p.add_argument("--threads", type=int, help="torch threads per rank")
    p.add_argument("--eval-batch-size", type=int)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--save-checkpoints", action="store_true",
                   help="keep every trained model as <out>/checkpoints/<run key>.pth (for benchmarks/analysis.py)")
    p.add_argument("--teacher-epochs", type=float, help="tokenlabel: the annotator's epochs (default: twice --epochs)")
    p.add_argument("--profile", choices=("scratch", "finetune"), help="finetune: train one base model on --base-data "
                   "first (once, cached), then fine-tune every cell from it")
    p.add_argument("--base-data", help="finetune: the base model's data (default imagenette for cifar10, else cifar10)")
    p.add_argument("--base-epochs", type=float, help="finetune: the base model's epochs (default 4x --epochs)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and the runs, train nothing")
    return p


def _csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


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


def _table(text: str) -> int | str:
    if text in ("7", "8"):
        return int(text)
    if text == "tokenlabel":
        return text
    raise argparse.ArgumentTypeError(f"--table takes 7, 8 or tokenlabel, got {text!r}")


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("all", "none") else int(text)


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
    """The given flags as a nested AblationConfig mapping."""
    where = {
        "data": ("data", "source"), "loader": ("data", "loader"), "img_size": ("data", "img_size"),
        "subset": ("data", "subset"), "test_subset": ("data", "test_subset"),
        "model": ("model", "name"), "patch_size": ("model", "patch_size"), "embed_dim": ("model", "embed_dim"),
        "depth": ("model", "depth"), "num_heads": ("model", "num_heads"), "drop_path": ("model", "drop_path"),
        "init": ("model", "init"), "pretrained": ("model", "pretrained"),
        "epochs": ("recipe", "epochs"), "max_steps": ("recipe", "max_steps"), "batch_size": ("recipe", "batch_size"),
        "lr": ("recipe", "lr"), "weight_decay": ("recipe", "weight_decay"), "warmup": ("recipe", "warmup"),
    }
    tree: dict[str, Any] = {}
    for name, value in flags.items():
        if name in ("config", "dry_run"):
            continue
        if name in where:
            section, field = where[name]
            tree.setdefault(section, {})[field] = value
        else:
            tree[name] = value
    return tree


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_config(argv: Sequence[str] | None = None) -> tuple[AblationConfig, bool]:
    """The job's config from defaults < the data set's preset < ``--config`` file < flags; and ``--dry-run``."""
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
    return AblationConfig.model_validate(tree), bool(args.get("dry_run", False))


def default_out(cfg: AblationConfig, source: Path | TorchvisionCIFAR10 | None = None) -> Path:
    """``runs/ablation/table<N>-<data>-<model>`` (``tokenlabel-<data>-<model>``) under the repository root.

    CIFAR-10 from torchvision's files is ``cifar10-torchvision``: other pixels (PNG-exact, not JPEG) and
    another image order than the bundled archive, so its runs are kept apart.
    """
    data = cfg.data.source if cfg.data.source in ("cifar10", "imagenette") else Path(cfg.data.source).name.split(".")[0]
    if isinstance(source, TorchvisionCIFAR10):
        data += "-torchvision"
    table = "tokenlabel" if cfg.table == "tokenlabel" else f"table{cfg.table}"
    profile = "-finetune" if cfg.profile == "finetune" else ""
    return REPO_ROOT / "runs" / "ablation" / f"{table}-{data}-{cfg.model.name}{profile}"


def locate_data(cfg: AblationConfig) -> Path | TorchvisionCIFAR10:
    """The configured data: the bundled archive or a path; ``cifar10`` without its archive is torchvision's CIFAR-10.

    Nothing is downloaded here (``ensure_files`` does that); the torchvision files may not exist yet.

    Raises:
        FileNotFoundError: a named archive other than cifar10, or a path, that does not exist.
    """
    if cfg.data.source == "cifar10":
        root = Path(cfg.data_root).expanduser().resolve() if cfg.data_root is not None else default_data_root()
        archive = root / NAMED["cifar10"]
        if not archive.exists():
            return TorchvisionCIFAR10(root=cache_root(cfg.cache_dir) / "torchvision", archive=archive)
    return resolve_source(cfg.data.source, cfg.data_root)


def data_origin(source: Path | TorchvisionCIFAR10) -> str | None:
    """What a run record says about its data beyond the config: None for an archive or a path (as before)."""
    return "torchvision-cifar10" if isinstance(source, TorchvisionCIFAR10) else None


# ------------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Planned:
    """One run of the job: a table cell at a seed, its full config and key."""

    cell: Cell
    seed: int
    run: RunConfig
    key: str

    @property
    def name(self) -> str:
        return f"{self.cell.row}{' +TL-Align' if self.cell.aligned else ''} seed {self.seed}"


def teacher_run(cfg: AblationConfig, num_classes: int, device_type: str) -> RunConfig:
    """The tokenlabel table's annotator: the job's model, globally average-pooled, trained with CutMix.

    A head trained on the mean of the patch tokens is meaningful on each token alone (as
    a CNN's is on each location: CAM), which is what a dense score map needs; a class
    token's head never sees a patch token. It trains for ``teacher_epochs`` (default:
    twice the rows' epochs) on the same training images, seed 0.
    """
    epochs = cfg.teacher_epochs if cfg.teacher_epochs is not None else 2 * cfg.recipe.epochs
    r = cfg.recipe
    cutmix = CutMixConfig(num_classes=num_classes, label_smoothing=r.label_smoothing, prob=r.mix_prob, alpha=1.0)
    return RunConfig(
        data=cfg.data,  # trained from scratch: a fine-tuning start has a class token the pooled teacher lacks
        model=cfg.model.model_copy(update={"class_token": False, "global_pool": "avg", "init": None, "pretrained": False}),
        recipe=r.model_copy(update={"epochs": epochs}), mixer=cutmix, scheme=NoAlignConfig(),
        seed=0, device_type=device_type, bf16=cfg.use_bf16(),
    )


def base_run(cfg: AblationConfig, num_classes: int, device_type: str) -> RunConfig:
    """The finetune profile's base model: the job's model trained with CutMix on ``base_data``, seed 0.

    All of the base data's training images at the job's image size, for ``base_epochs``
    (default: four times the rows' epochs); the cells then fine-tune it on the job's data.
    """
    source = cfg.base_data or ("imagenette" if cfg.data.source == "cifar10" else "cifar10")
    r = cfg.recipe
    epochs = cfg.base_epochs if cfg.base_epochs is not None else 4 * r.epochs
    # the base data must have the job's class count: the cells load the base's head strictly
    cutmix = CutMixConfig(num_classes=num_classes, label_smoothing=r.label_smoothing, prob=r.mix_prob, alpha=1.0)
    data = cfg.data.model_copy(update={"source": source, "loader": "tensor", "subset": None})
    return RunConfig(data=data, model=cfg.model, recipe=r.model_copy(update={"epochs": epochs}), mixer=cutmix,
                     scheme=NoAlignConfig(), init_sha256=_init_digest(cfg), seed=0, device_type=device_type,
                     bf16=cfg.use_bf16())


def _init_digest(cfg: AblationConfig) -> str | None:
    return file_digest(cfg.model.init) if cfg.model.init is not None else None  # a missing file fails here


def plan(cfg: AblationConfig, num_classes: int, device_type: str) -> list[Planned]:
    """Every (cell, seed) of the table in the paper's order, seeds innermost.

    Raises:
        ValueError: unknown row ids (the message lists the table's rows), no seeds, or a model the table cannot use.
    """
    if not cfg.seeds:
        raise ValueError("no seeds: pass --seeds 0,1 (at least one)")
    if len(set(cfg.seeds)) != len(cfg.seeds):
        raise ValueError(f"seeds must be distinct, got {list(cfg.seeds)}")
    known = row_ids(cfg.table)
    if cfg.rows is not None:
        unknown = [r for r in cfg.rows if r not in known]
        if unknown or not cfg.rows:
            raise ValueError(f"unknown row id(s) {unknown} for table {cfg.table}; its rows are: {', '.join(known)}")
    patch, img = _grid_of(cfg)
    cells = table_cells(
        cfg.table, num_classes=num_classes, label_smoothing=cfg.recipe.label_smoothing, prob=cfg.recipe.mix_prob,
        patch_size=patch, img_size=img, depth=cfg.model.resolved_depth(), drop_path=cfg.model.drop_path,
        extension=cfg.rows is not None,
    )
    if cfg.rows is not None:
        cells = [c for c in cells if c.row in cfg.rows]
    digest = _init_digest(cfg)
    model, base = cfg.model, None
    if cfg.profile == "finetune":  # every cell starts from the base run's weights: its key enters theirs
        base = run_key(base_run(cfg, num_classes, device_type))
        model, digest = cfg.model.model_copy(update={"init": None, "pretrained": False}), None
    annotator = None
    if any(c.annotated for c in cells):
        annotator = AnnotatorConfig(teacher=run_key(teacher_run(cfg, num_classes, device_type)))
    out = []
    for cell in cells:
        for seed in cfg.seeds:
            run = RunConfig(data=cfg.data, model=model, recipe=cfg.recipe, mixer=cell.mixer, scheme=cell.scheme,
                            annotator=annotator if cell.annotated else None, init_sha256=digest, base=base, seed=seed,
                            device_type=device_type,
                            bf16=cfg.use_bf16())
            out.append(Planned(cell, seed, run, run_key(run)))
    return out


def _grid_of(cfg: AblationConfig) -> tuple[int, int]:
    """``(patch size, image size)`` of the built model: the random and block-wise mixers use one cell per token."""
    model = cfg.model.build(num_classes=2)
    embed = getattr(model, "patch_embed", None)
    patch = getattr(embed, "patch_size", None)
    if not isinstance(patch, tuple) or patch[0] != patch[1]:
        raise ValueError(f"{cfg.model.name}: the ablation needs a ViT with square patches (timm's patch_embed.patch_size)")
    if cfg.data.img_size % patch[0]:
        raise ValueError(f"image size {cfg.data.img_size} is not a multiple of the patch size {patch[0]}")
    return int(patch[0]), cfg.data.img_size


# ------------------------------------------------------------------------------------------------- data


@dataclass
class Data:
    """The training split, the fixed test batches and the class count, for this rank."""

    num_classes: int
    make_train: Callable[[int], Batches]  # seed -> this run's training batches
    test: Batches
    train_split: TensorSplit | None = None  # the tensor loader's decoded training split (for the annotator)
    train_indices: Tensor | None = None  # the training subset's split indices


def load_data(cfg: AblationConfig, shard: Shard, source: Path | TorchvisionCIFAR10 | None = None) -> Data:
    """Open (decode or extract once) the configured data and shard it for this rank.

    ``source`` is ``locate_data(cfg)`` (looked up when not given); torchvision's CIFAR-10 files must be on disk.
    """
    from timm.data.random_erasing import RandomErasing
    from timm.data.transforms_factory import create_transform

    d, r = cfg.data, cfg.recipe
    source = locate_data(cfg) if source is None else source
    root = cache_root(cfg.cache_dir)
    if isinstance(source, TorchvisionCIFAR10) and d.loader != "tensor":
        raise ValueError(f"{source.name} is read as tensors only: pass --loader tensor (the default for cifar10), "
                         f"or put the bundled archive {source.archive.name} in {source.archive.parent}")
    if d.loader == "tensor":
        if isinstance(source, TorchvisionCIFAR10):
            train_split_, test_split_ = read_split(source, "train", d.img_size), read_split(source, "test", d.img_size)
            test_name = "test"
        else:
            train_name, test_name = train_split(source, root), eval_split(source, root)
            train_split_ = tensor_cache(source, train_name, d.img_size, root)
            test_split_ = tensor_cache(source, test_name, d.img_size, root)
        if train_split_.classes != test_split_.classes:
            raise ValueError(f"{source}: the train and {test_name} splits have different classes")
        train_idx = subset_indices(len(train_split_.labels), d.subset)
        test_idx = subset_indices(len(test_split_.labels), d.test_subset)
        erasing = (RandomErasing(probability=r.reprob, mode=r.remode, device=str(shard.device))  # type: ignore[no-untyped-call]
                   if r.reprob > 0 else None)
        common: dict[str, Any] = {"shard": shard, "mean": d.mean, "std": d.std}

        def make_tensor_train(seed: int) -> Batches:
            return TensorBatches(train_split_, train_idx, r.batch_size, train=True, seed=seed,
                                 crop_padding=d.crop_padding, hflip=d.hflip, erasing=erasing, **common)

        test: Batches = TensorBatches(test_split_, test_idx, cfg.eval_batch_size, train=False, seed=0, **common)
        num_classes = len(train_split_.classes)
        make_train: Callable[[int], Batches] = make_tensor_train
        decoded: tuple[TensorSplit, Tensor] | None = (train_split_, train_idx)
    else:
        assert not isinstance(source, TorchvisionCIFAR10)  # refused above
        train_name, test_name = train_split(source, root), eval_split(source, root)
        folder = extract(source, root)
        classes = sorted(p.name for p in (folder / train_name).iterdir() if p.is_dir())
        n_train, n_test = _count_images(folder / train_name), _count_images(folder / test_name)
        train_tf = create_transform(
            d.img_size, is_training=True, hflip=d.hflip, auto_augment=d.auto_augment, interpolation="bicubic",
            mean=d.mean, std=d.std, re_prob=r.reprob, re_mode=r.remode, color_jitter=0.3,
        )
        test_tf = create_transform(d.img_size, is_training=False, interpolation="bicubic", mean=d.mean, std=d.std)
        train_idx_f = subset_indices(n_train, d.subset) if d.subset is not None else None
        test_idx_f = subset_indices(n_test, d.test_subset) if d.test_subset is not None else None

        def make_folder_train(seed: int) -> Batches:
            return FolderBatches(folder / train_name, train_idx_f, r.batch_size, shard, train=True, seed=seed,
                                 transform=train_tf, workers=cfg.workers)

        test = FolderBatches(folder / test_name, test_idx_f, cfg.eval_batch_size, shard, train=False, seed=0,
                             transform=test_tf, workers=cfg.workers)
        num_classes = len(classes)
        make_train = make_folder_train
        decoded = None
    # fail before any training when the first run could not take a single step
    if r.max_steps is None and len(make_train(0)) < 1:
        raise ValueError(
            f"the training set ({d.subset or 'all'} images) is smaller than one global batch of {r.batch_size}: "
            "lower --batch-size or raise --subset"
        )
    split, indices = decoded if decoded is not None else (None, None)
    return Data(num_classes=num_classes, make_train=make_train, test=test, train_split=split, train_indices=indices)


def _count_images(split_dir: Path) -> int:
    """Images under ``<split>/<class>/`` (what timm's ImageDataset will index), for the fixed subsets."""
    from timm.data.readers.img_extensions import get_img_extensions

    ext = tuple(get_img_extensions())  # type: ignore[no-untyped-call]
    return sum(1 for c in split_dir.iterdir() if c.is_dir() for f in c.iterdir() if f.suffix.lower() in ext)


# ---------------------------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Report:
    """What a job did and found (rank 0; other ranks get ``trained``/``skipped`` only)."""

    out: Path
    trained: int
    skipped: int
    records: list[dict[str, Any]]
    markdown: str


def _read_done(runs_dir: Path, planned: Sequence[Planned], origin: str | None = None) -> dict[str, dict[str, Any]]:
    """The finished run files among the planned keys; a file that does not match its config or data is ignored."""
    done: dict[str, dict[str, Any]] = {}
    for p in planned:
        path = runs_dir / f"{p.key}.json"
        if not path.is_file():
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            warnings.warn(f"run file {path} cannot be read ({e}); treating {p.name} as not done: it is retrained and the file replaced", stacklevel=2)
            continue  # a torn or foreign file: the run is redone and the file replaced
        why = _record_problem(record)
        if why is not None:
            warnings.warn(f"run file {path} {why}; treating {p.name} as not done: it is retrained and the file replaced", stacklevel=2)
            continue
        run = record.get("run")
        if (record.get("key") == p.key and isinstance(run, dict) and keyed_dump(run) == keyed_dump(p.run)
                and record.get("data_origin") == origin):
            done[p.key] = record
    return done


def _record_problem(record: object) -> str | None:
    """Why a run file's content is not a finished run's record (``None`` if it is one)."""
    if not isinstance(record, dict):
        return f"holds a JSON {type(record).__name__}, not a run record"
    missing = [k for k in ("key", "run", "result") if k not in record]
    if missing:
        return f"has no {', '.join(repr(k) for k in missing)} entry"
    result = record["result"]
    if not isinstance(result, dict) or not all(isinstance(result.get(k), (int, float)) for k in ("top1", "steps")):
        return "has a \"result\" without numeric \"top1\" and \"steps\""
    return None


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_ablation(cfg: AblationConfig, *, dry_run: bool = False) -> Report:
    """Train and evaluate every missing run of the table, then write and print the table (rank 0)."""
    from tqdm import tqdm

    from benchmarks._train import train_and_evaluate

    shard = setup(cfg.device)
    try:
        threads = cfg.threads or _free_cores(shard)
        torch.set_num_threads(threads)
        lead = shard.rank == 0
        source = locate_data(cfg)  # a missing archive or path fails now, also in a dry run
        origin = data_origin(source)
        out = Path(cfg.out).expanduser().resolve() if cfg.out else default_out(cfg, source)
        job = provenance(device=str(shard.device))
        if cfg.recipe.batch_size < shard.world:
            raise ValueError(f"--batch-size {cfg.recipe.batch_size} is smaller than the number of ranks "
                             f"({shard.world}): every rank needs at least 2 images to mix")
        if lead:
            print(f"resolved config ({shard.world} rank{'s' if shard.world > 1 else ''} on {shard.device}, "
                  f"{threads} torch thread{'s' if threads > 1 else ''} per rank):")
            print(cfg.model_dump_json(indent=2))
            print(f"output: {out}", flush=True)
        if isinstance(source, TorchvisionCIFAR10):
            if lead:
                print(f"data: {source.name} (the bundled archive {source.archive} was not found)", flush=True)
                if not dry_run or not cfg.download:  # a dry run downloads nothing, but fails where a run would
                    ensure_files(source, allow_download=cfg.download and not dry_run)
                elif source.missing():
                    print(f"  a run downloads it with torchvision into {source.root} first", flush=True)
            barrier()
            if not dry_run and source.missing():  # another rank downloaded onto a disk this rank does not see
                raise FileNotFoundError(f"{source.folder} lacks {', '.join(source.missing())} on rank {shard.rank}")
        data = load_data(cfg, shard, source) if not dry_run else None
        num_classes = data.num_classes if data else _peek_classes(cfg)
        planned = plan(cfg, num_classes, shard.device.type)
        if data is not None and (cfg.model.init is not None or cfg.model.pretrained):
            cfg.model.initialised(num_classes)  # a checkpoint that does not fit fails now, not after the first run
        # rank 0 alone reads the run files: every rank takes the same decision even on node-local disks
        done = broadcast_from_zero(_read_done(out / "runs", planned, origin) if lead else {})
        ckpt_dir = out / "checkpoints"
        todo = [p for p in planned
                if p.key not in done or (cfg.save_checkpoints and not (ckpt_dir / f"{p.key}.pth").is_file())]
        if lead:
            print(f"table {cfg.table}: {len(planned)} runs ({len(planned) - len(todo)} already done, "
                  f"{len(todo)} to train)", flush=True)
            if any(p.run.annotator is not None for p in planned):
                print(f"  plus the annotator (teacher run {planned_teacher(cfg, planned, num_classes).key}, trained and scored "
                      "first unless done)", flush=True)
            if dry_run:
                for p in planned:
                    print(f"  {p.key}  {p.name}{'  (done)' if p.key in done else ''}")
        if dry_run or data is None:
            return Report(out, 0, len(planned) - len(todo), [], "")
        progress = lead and not cfg.quiet
        base: dict[str, Any] | None = None
        base_ckpt: Path | None = None
        if cfg.profile == "finetune":
            base, base_ckpt = prepare_base(cfg, planned, num_classes, shard, out, progress=progress, needed=bool(todo))
        teacher: dict[str, Any] | None = None
        labels_source: TokenLabelSource | None = None
        if any(p.run.annotator is not None for p in planned):
            teacher, labels_source = prepare_annotator(cfg, planned, data, shard, out, progress=progress,
                                                       needed=any(p.run.annotator is not None for p in todo),
                                                       origin=origin)
        overall = tqdm(total=len(todo), desc=f"table {cfg.table}", disable=not progress, position=0, dynamic_ncols=True)
        for i, p in enumerate(todo):
            labels = None
            if (p.run.annotator is not None and labels_source is not None
                    and isinstance(p.run.scheme, TokenLabelingConfig)):
                labels = replace(labels_source, fill=p.run.annotator.fill)
            result = train_and_evaluate(p.run, data.make_train(p.seed), data.test, shard, num_classes=data.num_classes,
                                        progress=progress, desc=p.name, token_labels=labels, init=base_ckpt,
                                        checkpoint=ckpt_dir / f"{p.key}.pth" if cfg.save_checkpoints else None)
            if lead:
                record = {"key": p.key, "run": p.run.model_dump(mode="json"), "result": asdict(result),
                          "world": shard.world, "device": str(shard.device), "finished": time.time(),
                          "data_origin": origin}
                write_atomic(out / "runs" / f"{p.key}.json", json.dumps(record, indent=1))
                done[p.key] = record
                tqdm.write(f"[{i + 1}/{len(todo)}] {p.name}: top-1 {result.top1:.2f}% "
                           f"({result.steps} steps, {result.train_seconds:.0f} s)")
            overall.update()
        overall.close()
        barrier()
        if not lead:
            return Report(out, len(todo), len(planned) - len(todo), [], "")
        records = [{"table": cfg.table, "row": p.cell.row, "label": p.cell.label, "aligned": p.cell.aligned,
                    "seed": p.seed, **done[p.key]} for p in planned]
        markdown = render_markdown(cfg, planned, records, teacher, base)
        job = {**finish(job), "data": str(source.folder if isinstance(source, TorchvisionCIFAR10) else source)}
        write_outputs(out, cfg, planned, records, markdown, teacher, base, job)
        print()
        print(markdown, flush=True)
        print(f"written: {out / 'table.md'}, runs.csv, deltas.csv, results.json, table.png")
        return Report(out, len(todo), len(planned) - len(todo), records, markdown)
    finally:
        teardown()


def prepare_base(cfg: AblationConfig, planned: Sequence[Planned], num_classes: int, shard: Shard, out: Path, *,
                 progress: bool, needed: bool) -> tuple[dict[str, Any], Path]:
    """The finetune profile's base model: trained once (unless its run file and checkpoint exist), then reused.

    Returns its run record and checkpoint ``<out>/base/<key>.pth``. ``needed``: a cell is
    still to train, so the checkpoint must exist (a deleted one is retrained).
    """
    from benchmarks._train import train_and_evaluate

    run = base_run(cfg, num_classes, planned[0].run.device_type)
    key = run_key(run)
    assert all(p.run.base == key for p in planned)
    cell = Cell("base", "base model", MixerFlags(cutmix=True), False, run.mixer, run.scheme)
    ckpt = out / "base" / f"{key}.pth"  # <out>/runs/<key>.json beside it: benchmarks/analysis.py reads its heads
    found = _read_done(out / "runs", [Planned(cell, run.seed, run, key)]) if shard.rank == 0 else {}
    done = broadcast_from_zero(found if ckpt.is_file() or not needed else {})
    if key not in done:
        data = load_data(cfg.model_copy(update={"data": run.data}), shard)
        if data.num_classes != num_classes:
            raise ValueError(f"the base data {run.data.source} has {data.num_classes} classes and the job's "
                             f"{cfg.data.source} {num_classes}: the cells load the base's classifier strictly; "
                             "pick a --base-data with as many classes")
        result = train_and_evaluate(run, data.make_train(run.seed), data.test, shard, num_classes=num_classes,
                                    progress=progress, desc="base model", checkpoint=ckpt)
        record = {"key": key, "run": run.model_dump(mode="json"), "result": asdict(result), "world": shard.world,
                  "device": str(shard.device), "finished": time.time()}
        if shard.rank == 0:
            write_atomic(out / "runs" / f"{key}.json", json.dumps(record, indent=1))
            print(f"base model: top-1 {result.top1:.2f}% on {run.data.source} ({result.steps} steps, "
                  f"{result.train_seconds:.0f} s)", flush=True)
        done[key] = record
    barrier()
    return done[key], ckpt


def _base_line(base: dict[str, Any]) -> str:
    """The finetune profile's base model under the table."""
    run, result = base["run"], base["result"]
    return (f"Fine-tuned from one base model: {run['model']['name']} trained with CutMix on {run['data']['source']} "
            f"at {run['data']['img_size']} px for {run['recipe']['epochs']:g} epochs ({result['steps']} steps, seed "
            f"{run['seed']}; top-1 {result['top1']:.2f}% on its own test images), then every cell from it.")


def planned_teacher(cfg: AblationConfig, planned: Sequence[Planned], num_classes: int) -> Planned:
    """The annotator's run, planned like a cell (its key names its run file, checkpoint and score maps)."""
    annotated = next(p for p in planned if p.run.annotator is not None)
    run = teacher_run(cfg, num_classes, annotated.run.device_type)
    cell = Cell("teacher", "annotator (teacher)", MixerFlags(cutmix=True), False, run.mixer, run.scheme)
    planned_key = run_key(run)
    assert annotated.run.annotator is not None and annotated.run.annotator.teacher == planned_key
    return Planned(cell, run.seed, run, planned_key)


def prepare_annotator(
    cfg: AblationConfig,
    planned: Sequence[Planned],
    data: Data,
    shard: Shard,
    out: Path,
    *,
    progress: bool,
    needed: bool,
    origin: str | None = None,
) -> tuple[dict[str, Any], TokenLabelSource | None]:
    """Train the teacher (unless done), score the training images with it (resumable), open the maps.

    Returns the teacher's run record and, when ``needed`` (an annotator row is still to
    train), the maps on this rank's device. The teacher's checkpoint is
    ``<out>/annotator/teacher-<key>.pth`` and its maps ``<out>/annotator/score-maps-<key>-top<k>``.
    """
    from benchmarks._train import train_and_evaluate

    if data.train_split is None or data.train_indices is None:
        raise ValueError("the tokenlabel table's annotator rows need the tensor loader (--loader tensor): token "
                         "labels are aligned to each image's crop, which timm's folder transforms do not report")
    lead = shard.rank == 0
    teacher = planned_teacher(cfg, planned, data.num_classes)
    annotator = next(p.run.annotator for p in planned if p.run.annotator is not None)
    assert annotator is not None
    ckpt = out / "annotator" / f"teacher-{teacher.key}.pth"
    found = _read_done(out / "runs", [teacher], origin) if lead else {}
    done = broadcast_from_zero(found if ckpt.is_file() else {})
    if teacher.key not in done:
        result = train_and_evaluate(teacher.run, data.make_train(teacher.seed), data.test, shard,
                                    num_classes=data.num_classes, progress=progress, desc="teacher (annotator)",
                                    checkpoint=ckpt)
        record = {"key": teacher.key, "run": teacher.run.model_dump(mode="json"), "result": asdict(result),
                  "world": shard.world, "device": str(shard.device), "finished": time.time(), "data_origin": origin}
        if lead:
            write_atomic(out / "runs" / f"{teacher.key}.json", json.dumps(record, indent=1))
            print(f"teacher (annotator): top-1 {result.top1:.2f}% ({result.steps} steps, {result.train_seconds:.0f} s)",
                  flush=True)
        done[teacher.key] = record
    barrier()
    store_dir = out / "annotator" / f"score-maps-{teacher.key}-top{annotator.k}"
    if lead:
        model = teacher.run.model.build(data.num_classes)
        model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True))
        meta = {"teacher": teacher.key, "model": teacher.run.model.model_dump(mode="json"),
                "img_size": [cfg.data.img_size, cfg.data.img_size]}
        store = annotate_split(model, data.train_split, data.train_indices, store_dir, mean=cfg.data.mean,
                               std=cfg.data.std, k=annotator.k, meta=meta, device=shard.device, progress=progress)
        hm, wm = store.map_size
        done[teacher.key]["score_maps"] = {"path": str(store_dir), "images": len(store), "bytes": store.nbytes,
                                           "bytes_per_image": store.nbytes / max(1, len(store)),
                                           "map_size": [hm, wm], "k": store.k}
    barrier()
    if not needed:
        return done[teacher.key], None
    patch, img = _grid_of(cfg)
    source = TokenLabelSource.open(ScoreMaps(store_dir), len(data.train_split.labels),
                                   fill=annotator.fill, grid=(img // patch, img // patch), device=shard.device)
    return done[teacher.key], source


def _free_cores(shard: Shard) -> int:
    """Torch threads per rank when ``--threads`` is not given: the cores other processes leave idle.

    On a CPU shared with other jobs, more OpenMP threads than idle cores make every
    step wait at barriers for descheduled threads: on 2 busy cores a training step of
    the default model took 2-5 s with 2 threads and 0.5-0.6 s with 1.
    """
    cores = os.cpu_count() or 1
    if shard.device.type == "cuda":
        return max(1, min(4, cores // max(1, shard.world)))  # only the input pipeline runs on the host
    try:
        busy = os.getloadavg()[0]
    except OSError:  # not every platform has a load average
        busy = 0.0
    per_rank = cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", shard.world)))
    return max(1, min(per_rank, round(cores - busy)))


def _peek_classes(cfg: AblationConfig) -> int:
    """The class count for a dry run without decoding: the named data sets have 10."""
    return 10 if cfg.data.source in ("cifar10", "imagenette") else 1000


# ---------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Stat:
    """Mean and sample std over seeds of one cell (``std`` is None with one seed)."""

    mean: float
    std: float | None
    n: int

    def __str__(self) -> str:
        return f"{self.mean:.2f}" if self.std is None else f"{self.mean:.2f} ± {self.std:.2f}"


def _stat(values: Sequence[float]) -> Stat | None:
    if not values:
        return None
    return Stat(statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None, len(values))


@dataclass(frozen=True)
class Delta:
    """One reported difference: a row's cell against its reference (same seeds, same data order)."""

    row: str
    label: str
    against: str  # "without TL-Align" (Table 7) or the baseline row's id
    delta: PairedDelta


def table_deltas(cfg: AblationConfig, planned: Sequence[Planned], records: Sequence[dict[str, Any]]) -> list[Delta]:
    """Every delta the table reports: Table 7's aligned minus unaligned per row, else each row minus the baseline."""
    cells = summarise(records)
    rows = list(dict.fromkeys((p.cell.row, p.cell.label) for p in planned))
    out: list[Delta] = []
    if cfg.table == 7:
        for row, label in rows:
            d = paired_delta(cells.get((row, False), {}), cells.get((row, True), {}))
            if d is not None:
                out.append(Delta(row, label, "without TL-Align", d))
        return out
    first = "cutmix" if cfg.table == "tokenlabel" else "none"
    baseline = cells.get((first, False), {})
    for row, label, aligned in dict.fromkeys((p.cell.row, p.cell.label, p.cell.aligned) for p in planned):
        d = paired_delta(baseline, cells.get((row, aligned), {})) if row != first else None
        if d is not None:
            out.append(Delta(row, label, first, d))
    return out


def summarise(records: Sequence[dict[str, Any]]) -> dict[tuple[str, bool], dict[int, float]]:
    """``(row, aligned) -> {seed: top-1}``."""
    by_cell: dict[tuple[str, bool], dict[int, float]] = {}
    for rec in records:
        by_cell.setdefault((rec["row"], rec["aligned"]), {})[rec["seed"]] = float(rec["result"]["top1"])
    return by_cell


def _fmt(values: dict[int, float] | None) -> str:
    stat = _stat(list(values.values())) if values else None
    return "-" if stat is None else str(stat)


def render_markdown(cfg: AblationConfig, planned: Sequence[Planned], records: Sequence[dict[str, Any]],
                    teacher: dict[str, Any] | None = None, base_model: dict[str, Any] | None = None) -> str:
    """The table in the paper's shape, with a caption saying what was run."""
    cells = summarise(records)
    deltas = {d.row: str(d.delta) for d in table_deltas(cfg, planned, records)}
    rows: list[Cell] = []
    for p in planned:
        if all(p.cell.row != c.row or p.cell.aligned != c.aligned for c in rows):
            rows.append(p.cell)
    m = cfg.model
    size = f"{m.name}" + (f" (dim {m.embed_dim}, depth {m.depth}, patch {m.patch_size})" if m.embed_dim else "")
    steps = {int(r["result"]["steps"]) for r in records}
    name = "Token labeling table" if cfg.table == "tokenlabel" else f"Table {cfg.table}"
    caption = (f"{name} on {cfg.data.source} ({cfg.data.subset or 'all'} train / "
               f"{cfg.data.test_subset or 'all'} test images), {size}, {'/'.join(map(str, sorted(steps)))} steps of "
               f"{cfg.recipe.batch_size}; top-1 (%) as mean ± std over seeds {', '.join(map(str, cfg.seeds))}; "
               f"Δ = mean of the paired per-seed differences [95% t interval], seeds where it was positive / seeds, "
               f"and '{NO_DIFFERENCE}' where the interval spans 0 (one seed: no interval).")
    lines = [caption, ""]
    mark = {True: "✓", False: "×"}
    if cfg.table == 7:
        beyond = any(c.flags.other for c in rows)  # rows beyond the paper get a column naming their mixer
        lines += ["| MixUp | CutMix | Random | Block-wise |" + (" Beyond the paper |" if beyond else "")
                  + " Top-1 (%) | +TL-Align Top-1 (%) | Δ |",
                  "| :-: | :-: | :-: | :-: |" + (" :-: |" if beyond else "") + " --: | --: | --: |"]
        for row in dict.fromkeys(c.row for c in rows):
            flags = next(c.flags for c in rows if c.row == row)
            base, aligned = cells.get((row, False)), cells.get((row, True))
            has_aligned = any(c.row == row and c.aligned for c in rows)
            other = f" {flags.other or '×'} |" if beyond else ""
            lines.append(
                f"| {mark[flags.mixup]} | {mark[flags.cutmix]} | {mark[flags.random]} | {mark[flags.blockwise]} |{other}"
                f" {_fmt(base)} | {_fmt(aligned) if has_aligned else '-'} "
                f"| {deltas.get(row, '-')} |"
            )
    else:  # one column, each row against the baseline row: Table 8's "none", the tokenlabel table's CutMix
        first = "cutmix" if cfg.table == "tokenlabel" else "none"
        against = "Δ vs CutMix (%)" if cfg.table == "tokenlabel" else "Δ (%)"
        lines += [f"| {'Training' if cfg.table == 'tokenlabel' else 'Alignment'} | Top-1 (%) | {against} |",
                  "| :-- | --: | --: |"]
        for c in rows:
            values = cells.get((c.row, c.aligned))
            delta = deltas.get(c.row, "-") if c.row != first else "-"
            lines.append(f"| {c.label} | {_fmt(values)} | {delta} |")
        if teacher is not None:
            lines += ["", _teacher_line(teacher)]
    if base_model is not None:
        lines += ["", _base_line(base_model)]
    return "\n".join(lines) + "\n"


def _teacher_line(teacher: dict[str, Any]) -> str:
    """The annotator under the token-labeling table: what it is, how good it is, what its maps cost."""
    run, result = teacher["run"], teacher["result"]
    model = run["model"]
    maps = teacher.get("score_maps")
    stored = (f"; its maps: {maps['images']} images, {maps['map_size'][0]}x{maps['map_size'][1]} cells, top-{maps['k']}, "
              f"{maps['bytes_per_image']:.0f} bytes per image" if maps else "")
    return (f"Annotator: {model['name']} with global average pooling and no class token (dim {model['embed_dim']}, "
            f"depth {model['depth']}, patch {model['patch_size']}), trained with CutMix for {run['recipe']['epochs']:g} "
            f"epochs ({result['steps']} steps, seed {run['seed']}): top-1 {result['top1']:.2f}%{stored}.")


_CSV_FIELDS = ("table", "row", "label", "aligned", "seed", "key", "mixer", "scheme", "top1", "correct", "evaluated",
               "train_loss", "steps", "train_seconds", "eval_seconds", "images_per_second", "world", "device")


_DELTA_FIELDS = ("table", "row", "label", "against", "n", "mean", "ci_low", "ci_high", "positive", "verdict")


def write_outputs(out: Path, cfg: AblationConfig, planned: Sequence[Planned], records: Sequence[dict[str, Any]],
                  markdown: str, teacher: dict[str, Any] | None = None, base: dict[str, Any] | None = None,
                  job: dict[str, Any] | None = None) -> None:
    """``table.md``, ``runs.csv``, ``deltas.csv``, ``results.json`` and ``table.png`` in ``out``, each atomically.

    ``job`` is the job's provenance (``benchmarks._provenance``: date, command, machine, torch), kept in
    ``results.json`` for ``python -m benchmarks.report``.
    """
    write_atomic(out / "table.md", markdown)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=_CSV_FIELDS)
    writer.writeheader()
    for rec in records:
        run = rec["run"]
        writer.writerow({
            **{k: rec[k] for k in ("table", "row", "label", "aligned", "seed", "key", "world", "device")},
            "mixer": (run["mixer"] or {}).get("kind", "none"), "scheme": (run["scheme"] or {}).get("kind", "none"),
            **{k: rec["result"][k] for k in _CSV_FIELDS if k in rec["result"]},
        })
    write_atomic(out / "runs.csv", buf.getvalue())
    deltas = [{"row": d.row, "label": d.label, "against": d.against, **d.delta.as_dict()}
              for d in table_deltas(cfg, planned, records)]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=_DELTA_FIELDS)
    writer.writeheader()
    writer.writerows({"table": cfg.table, **d} for d in deltas)
    write_atomic(out / "deltas.csv", buf.getvalue())
    results = {"config": cfg.model_dump(mode="json"), "table": markdown, "runs": list(records), "deltas": deltas,
               "annotator": teacher, "base": base, "provenance": job}
    write_atomic(out / "results.json", json.dumps(results, indent=1))
    plot(out / "table.png", cfg, planned, records)


def plot(path: Path, cfg: AblationConfig, planned: Sequence[Planned], records: Sequence[dict[str, Any]]) -> None:
    """A bar chart of the table: mean top-1 per cell with the std over seeds as error bars."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the chart goes to a file
    import matplotlib.pyplot as plt

    cells = summarise(records)
    order = list(dict.fromkeys(p.cell.row for p in planned))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(order) + 1.5), 4.0), dpi=120)
    columns = [(False, "baseline", "#9aa5b1"), (True, "+TL-Align", "#d1495b")] if cfg.table == 7 else [(None, "", "")]
    width = 0.8 / len(columns)
    lows: list[float] = []
    for j, (aligned, name, color) in enumerate(columns):
        xs, means, errs = [], [], []
        for i, row in enumerate(order):
            key = (row, aligned) if aligned is not None else next(k for k in cells if k[0] == row)
            stat = _stat(list(cells.get(key, {}).values()))
            if stat is None:
                continue
            xs.append(i + (j - (len(columns) - 1) / 2) * width)
            means.append(stat.mean)
            errs.append(stat.std or 0.0)
            lows.append(stat.mean - (stat.std or 0.0))
        kwargs: dict[str, Any] = {"label": name, "color": color} if name else {"color": "#3c6e71"}
        ax.bar(xs, means, width=width, yerr=errs, capsize=4, **kwargs)
    ax.set_xticks(range(len(order)))
    ax.set_xticklabels(order, rotation=15)
    xlabels: dict[int | str, str] = {7: "mixing strategy", 8: "alignment", "tokenlabel": "training"}
    ax.set_xlabel(xlabels[cfg.table])
    ax.set_ylabel("top-1 accuracy (%)")
    if lows:  # bars start near the data: at this scale the differences are a few points
        ax.set_ylim(bottom=max(0.0, math.floor(min(lows) - 5)))
    ax.set_title(f"{'Token labeling' if cfg.table == 'tokenlabel' else f'Table {cfg.table}'}: {cfg.data.source}, {cfg.model.name}, seeds {','.join(map(str, cfg.seeds))}")
    if cfg.table == 7:
        ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------- cli


def main(argv: Sequence[str] | None = None) -> int:
    """The command line entry point; returns the exit status."""
    try:
        cfg, dry_run = resolve_config(argv)
        run_ablation(cfg, dry_run=dry_run)
    except (FileNotFoundError, ValueError, PretrainedUnavailable) as err:
        from pydantic import ValidationError

        if isinstance(err, ValidationError):
            print(f"ablation: invalid configuration:\n{err}", file=sys.stderr)
        else:
            print(f"ablation: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
