"""The fields every config section shares: strict frozen models, the error that names
a field, the constrained number types."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

PositiveInt = Annotated[int, Field(gt=0)]


PositiveFloat = Annotated[float, Field(gt=0)]


Fraction = Annotated[float, Field(ge=0, le=1)]


ArchName = Literal["byte", "llama"]  # diloco.archs.ARCHS


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
