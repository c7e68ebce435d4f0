"""Where the ablation's images come from and how they reach a rank: locating, opening, sharding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from benchmarks._archive import (
    NAMED,
    REPO_ROOT,
    TensorSplit,
    cache_root,
    default_data_root,
    eval_split,
    extract,
    resolve_source,
    split_counts,
    tensor_cache,
    train_split,
)
from benchmarks._cifar_batches import TorchvisionCIFAR10, read_split
from benchmarks._ablation_config import AblationConfig
from benchmarks._data import Batches, FolderBatches, Shard, TensorBatches, subset_indices

__all__ = ["Data", "Sizes", "default_out", "locate_data", "data_origin", "load_data", "peek_sizes", "check_subsets",
           "check_base_classes"]


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
        check_subsets(cfg, Sizes(len(train_split_.classes), len(train_split_.labels), len(test_split_.labels), d.source))
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
        check_subsets(cfg, Sizes(len(classes), n_train, n_test, d.source))
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


@dataclass(frozen=True)
class Sizes:
    """A data set's class count and the images of its training and evaluation splits."""

    num_classes: int
    train: int
    test: int
    name: str  # the data set as the user named it (--data), for messages


# torchvision's CIFAR-10 files: fixed sizes (the files may not be on disk yet in a dry run)
_TORCHVISION_CIFAR10 = (10, 50_000, 10_000)


def peek_sizes(cfg: AblationConfig, source: Path | TorchvisionCIFAR10) -> Sizes:
    """The data's sizes without decoding it (a dry run): class folders and images counted, an archive's list read once.

    Raises:
        FileNotFoundError: the tree has no train split, or neither a val nor a test split.
    """
    if isinstance(source, TorchvisionCIFAR10):
        return Sizes(*_TORCHVISION_CIFAR10, name=cfg.data.source)
    counts = split_counts(source, cache_root(cfg.cache_dir))
    if "train" not in counts:
        raise FileNotFoundError(f"{source} has no train/ split (splits found: {', '.join(counts)})")
    test = next((counts[s] for s in ("val", "test") if s in counts), None)
    if test is None:
        raise FileNotFoundError(f"{source} has neither a val/ nor a test/ split (splits found: {', '.join(counts)})")
    return Sizes(num_classes=counts["train"][0], train=counts["train"][1], test=test[1], name=cfg.data.source)


def check_subsets(cfg: AblationConfig, sizes: Sizes) -> None:
    """Refuse a subset larger than its split: the job would train on fewer images than its records claim.

    Raises:
        ValueError: ``subset`` above the training images or ``test_subset`` above the evaluation images.
    """
    for flag, asked, there, what in (("--subset", cfg.data.subset, sizes.train, "training"),
                                     ("--test-subset", cfg.data.test_subset, sizes.test, "evaluation")):
        if asked is not None and asked > there:
            raise ValueError(f"{flag} {asked} asks for more {what} images than {sizes.name} has ({there}): "
                             f"pass {flag} {there} or fewer, or {flag} all for every image")


def check_base_classes(base: str, base_classes: int, job: str, job_classes: int) -> None:
    """The finetune profile's base data must have the job's class count: the cells load the base's head strictly."""
    if base_classes != job_classes:
        raise ValueError(f"the base data {base} has {base_classes} classes and the job's {job} {job_classes}: the "
                         "cells load the base's classifier strictly; pick a --base-data with as many classes")
