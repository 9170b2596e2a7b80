"""What every configuration section is: a typed group of flags with its own rules."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A flag combination that cannot work; the message says what to set instead."""


class Section(BaseModel):
    """A group of flags, typed, each with its description; its cross-flag rules are its
    `problems()` (they may read flags of other sections: every rule runs on the whole RunConfig).
    A one-flag rule is a bound on the field itself (ge / gt / le, and a `hint` that says what to do)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False, frozen=True)

    def problems(self) -> list[str]:
        return []

