"""The distribution a user installs: one import name, typed, and the README's snippet runs from it.

Built as ``pip install .`` builds it (an sdist, then a wheel from the unpacked sdist),
offline: setuptools runs in this interpreter (no build isolation, nothing fetched).
The wheel is installed with ``--no-deps --no-index`` into a fresh virtual environment
that sees this environment's third-party packages (torch, timm, ...) through a ``.pth``
line naming their site-packages. Lines of a ``.pth`` file only extend ``sys.path``;
``.pth`` files inside the added directory are not processed, so this environment's
editable install of the repository (its ``__editable__`` finder) is not loaded there,
which the test checks. The snippet runs from a directory holding a user's own
``backbones/`` and ``strategies/`` packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from test_readme import REPO, python_block

PACKAGE_SOURCES = ("mixlabels", "strategies", "backbones")  # the last two are linked in as mixlabels.<name>


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _clean_env() -> dict[str, str]:
    """This environment minus anything that would put the repository on ``sys.path``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _typed_markers() -> set[str]:
    """``mixlabels/.../py.typed`` for every typed package of the source tree (through the links)."""
    found = set()
    for top in PACKAGE_SOURCES:
        for marker in (REPO / top).rglob("py.typed"):
            rel = marker.relative_to(REPO).as_posix()
            found.add(rel if top == "mixlabels" else f"mixlabels/{rel}")
    return found


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """sdist from a copy of the repository's files, then a wheel from the unpacked sdist."""
    import setuptools

    version = tuple(int(x) for x in setuptools.__version__.split(".")[:2])
    assert version >= (70, 1), (f"setuptools {setuptools.__version__} cannot build wheels by itself: "
                                "pip install -e '.[dev]' installs setuptools>=70.1")
    tmp = tmp_path_factory.mktemp("dist")
    checkout = tmp / "checkout"  # the files a build reads, copied so that its egg-info stays out of the repository
    for name in ("pyproject.toml", "README.md"):
        checkout.mkdir(exist_ok=True)
        shutil.copy2(REPO / name, checkout / name)
    for name in PACKAGE_SOURCES:
        shutil.copytree(REPO / name, checkout / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    assert (checkout / "mixlabels" / "strategies").is_symlink() and (checkout / "mixlabels" / "backbones").is_symlink()
    dist = tmp / "dist"
    build = "from setuptools import build_meta as b; import sys; print(getattr(b, sys.argv[1])(sys.argv[2]))"
    sdist = dist / _run([sys.executable, "-c", build, "build_sdist", str(dist)], checkout).split()[-1]
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "unpacked", filter="data")
    (source,) = (tmp / "unpacked").iterdir()
    wheel = dist / _run([sys.executable, "-c", build, "build_wheel", str(dist)], source).split()[-1]
    return {"sdist": sdist, "wheel": wheel, "tmp": tmp}


def test_wheel_has_one_top_level_name_and_its_type_markers(built: dict[str, Path]) -> None:
    with zipfile.ZipFile(built["wheel"]) as z:
        names = z.namelist()
        top_level = z.read(next(n for n in names if n.endswith(".dist-info/top_level.txt"))).decode().split()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"mixlabels"}
    assert top_level == ["mixlabels"]
    for package in ("mixlabels/strategies/", "mixlabels/backbones/", "mixlabels/score_maps/"):
        assert f"{package}__init__.py" in names, package
    assert not any(n.startswith(("benchmarks/", "tests/")) for n in names)
    markers = _typed_markers()
    assert {"mixlabels/py.typed", "mixlabels/strategies/py.typed", "mixlabels/backbones/py.typed"} <= markers
    assert markers <= set(names), markers - set(names)
    with tarfile.open(built["sdist"]) as tar:
        in_sdist = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert markers <= in_sdist, markers - in_sdist


def test_readme_snippet_runs_from_the_wheel_beside_a_users_own_packages(built: dict[str, Path]) -> None:
    tmp = built["tmp"]
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp)
    python = venv / "bin" / "python"
    site_dir = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp).strip())
    outer = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    assert outer, f"no site-packages on this interpreter's sys.path: {sys.path}"
    (site_dir / "outer_site_packages.pth").write_text("".join(f"{p}\n" for p in outer))
    env = _clean_env()

    # before the wheel: torch is there, mixlabels is not (this environment's editable install does not leak in)
    probe = "import importlib.util as u; print(u.find_spec('torch') is not None, u.find_spec('mixlabels') is None)"
    assert _run([str(python), "-c", probe], tmp, env).split() == ["True", "True"]

    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet",
          str(built["wheel"])], tmp, env)

    project = tmp / "user-project"  # a user's training project with its own packages of the same names
    for name in ("backbones", "strategies"):
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(f'WHOSE = "the user\'s own {name}/ folder"\n')
    snippet = python_block("## In a timm training loop")
    (project / "snippet.py").write_text(snippet)
    (project / "check.py").write_text(
        "import importlib, json, runpy, sys\n"
        "ns = runpy.run_path('snippet.py', run_name='__main__')\n"
        "import mixlabels, torch\n"
        "print(json.dumps({\n"
        "    'mixlabels': mixlabels.__file__,\n"
        "    'modules': {k: (v.__name__, v.__file__) for k, v in ns.items() if type(v).__name__ == 'module'},\n"
        "    'loss': float(ns['loss']), 'logits': list(ns['logits'].shape),\n"
        "    'user': [importlib.import_module(n).WHOSE for n in ('backbones', 'strategies')],\n"
        "    'editable': [repr(f) for f in sys.meta_path if 'editable' in repr(f).lower()],\n"
        "}))\n"
    )
    out = json.loads(_run([str(python), "check.py"], project, env).strip().splitlines()[-1])
    assert Path(out["mixlabels"]).is_relative_to(site_dir), out["mixlabels"]
    modules = out["modules"]
    assert modules["backbones"][0] == "mixlabels.backbones" and modules["strategies"][0] == "mixlabels.strategies"
    assert all(Path(f).is_relative_to(site_dir) for name, (_, f) in modules.items() if name.startswith(("mixlabels",
               "backbones", "strategies"))), modules
    assert out["logits"] == [8, 10] and out["loss"] == out["loss"] and 0.0 < out["loss"] < 10.0
    assert out["user"] == ["the user's own backbones/ folder", "the user's own strategies/ folder"]
    assert out["editable"] == []
