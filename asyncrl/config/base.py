"""What every config section shares: one-line errors and the strict pydantic base."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

SEED_LIMIT = 2**63  # a seed is a non-negative int64, as torch.manual_seed and numpy take it
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]


class ConfigError(ValueError):
    """A configuration problem, always a single line naming the offending field."""


class Section(BaseModel):
    """A config section: unknown keys are errors, and assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds, or None for a plain value."""
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
