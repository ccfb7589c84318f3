"""What every config section shares: one-line errors, the strict pydantic base, and the base of a
section that names a part."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

SEED_LIMIT = 2**63  # a seed is a non-negative int64, as torch.manual_seed and numpy take it
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]


class ConfigError(ValueError):
    """A configuration problem, always a single line naming the offending field."""


class Section(BaseModel):
    """A config section: unknown keys are errors, and assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PartSection(Section):
    """A section naming a part (docs/plugins.md): ``name``, a built-in of ``kind`` or
    ``package.module:attr``, and ``options``, the part's settings. Loading checks the name only, so
    no user code runs; ``parts.check_parts`` resolves the part and checks its options against its
    ``Options`` model. A subclass sets ``kind`` and ``at`` and gives both fields their default and
    description; its own fields follow them."""

    kind: ClassVar[str]  # the kind of part ``name`` resolves against (asyncrl.plugins.BUILTINS)
    at: ClassVar[str]  # where the section sits in a run config, as its errors name it: data.task

    name: str | None
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _named(self) -> Self:
        from asyncrl.plugins import check_spec

        if self.name is not None:
            check_spec(self.kind, self.name, f"{self.at}.name")
        return self


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds, or None for a plain value."""
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
