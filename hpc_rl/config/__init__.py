"""The typed config schema, Hydra composition and validation."""

from .compose import load_config, to_yaml
from .errors import ConfigError, Violation
from .schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "Violation", "load_config", "to_yaml"]
