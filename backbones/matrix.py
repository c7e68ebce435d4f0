"""Print the support matrix as markdown: ``python -m backbones.matrix``."""

from backbones._matrix import support_markdown

if __name__ == "__main__":
    print(support_markdown(), end="")
