"""The schema's building blocks: the section base every config model derives from, and the error the loader raises."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""



class Section(BaseModel):
    # no setting is infinite or NaN: `decode.temperature=inf` is an error, not a decoder that samples nothing
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

