"""The pydantic base of every mixlabels configuration."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

__all__ = ["Config"]

T_co = TypeVar("T_co", covariant=True)


class Config(BaseModel, Generic[T_co]):
    """Frozen, strict configuration that builds the object it describes.

    Subclasses declare typed fields (``Annotated[..., Field(ge=..., description=...)]``)
    and, where several variants exist, a ``Literal`` ``kind`` field to key them.
    Modules take plain typed arguments; ``build()`` turns a config into one.

    Example:
        >>> from typing import Literal
        >>> class Scale(Config[float]):
        ...     kind: Literal["scale"] = "scale"
        ...     factor: float = 2.0
        ...     def build(self) -> float:
        ...         return self.factor
        >>> Scale(factor=3.0).build()
        3.0
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    def build(self, *args: Any, **kwargs: Any) -> T_co:
        """Build the object this configuration describes."""
        raise NotImplementedError(f"{type(self).__name__} does not define build()")
