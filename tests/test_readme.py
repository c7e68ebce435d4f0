"""The README's snippets run as written (its generated support summary, and docs/families.md's matrix, are checked
with the support matrix in ``test_matrix.py``: built once there)."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch

from mixlabels.backbones.matrix import END, START, replace_section

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"


def python_block(heading: str, text: str | None = None) -> str:
    """The first python code block under ``heading`` (a whole line of the README, e.g. ``## In a timm training loop``)."""
    text = README.read_text() if text is None else text
    lines = text.splitlines()
    assert heading in lines, f"README.md has no line {heading!r}"
    rest = lines[lines.index(heading) + 1 :]
    start = rest.index("```python") + 1
    end = rest.index("```", start)
    return "\n".join(rest[start:end]) + "\n"


def test_replace_section_replaces_only_between_markers() -> None:
    text = f"intro\n{START}\nold\n{END}\noutro\n"
    assert replace_section(text, "new\n") == f"intro\n{START}\nnew\n{END}\noutro\n"


def test_python_block_takes_the_first_block_under_its_heading() -> None:
    text = "## A\n```python\na = 1\n```\n## B\ntext\n```python\nb = 2\nc = 3\n```\n"
    assert python_block("## B", text) == "b = 2\nc = 3\n"


def test_timm_loop_snippet_trains_a_step(tmp_path: Path) -> None:
    (tmp_path / "snippet.py").write_text(python_block("## In a timm training loop"))
    ns = runpy.run_path(str(tmp_path / "snippet.py"), run_name="__main__")
    model, loss, logits = ns["model"], ns["loss"], ns["logits"]
    assert torch.isfinite(loss) and logits.shape == (8, 10)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_core_type_snippet_runs(tmp_path: Path) -> None:
    (tmp_path / "snippet.py").write_text(python_block("## The core type"))
    ns = runpy.run_path(str(tmp_path / "snippet.py"), run_name="__main__")
    torch.testing.assert_close(ns["target"].sum(-1), torch.ones(4))
    assert ns["lm"].token_weights((8, 8)).shape == (4, 64, 2)
