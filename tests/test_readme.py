"""The README's generated parts match what the code generates."""

from __future__ import annotations

from pathlib import Path

from mixlabels.backbones._matrix import support_markdown
from mixlabels.backbones.matrix import END, START, replace_section

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_support_matrix_is_generated_from_the_registry() -> None:
    text = README.read_text()
    assert replace_section(text, support_markdown()) == text, (
        "README.md's support matrix is out of date: run python -m mixlabels.backbones.matrix --write README.md"
    )


def test_replace_section_replaces_only_between_markers() -> None:
    text = f"intro\n{START}\nold\n{END}\noutro\n"
    assert replace_section(text, "new\n") == f"intro\n{START}\nnew\n{END}\noutro\n"
