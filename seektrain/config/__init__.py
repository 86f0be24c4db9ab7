"""Typed run configuration loaded from TOML with command-line overrides."""

from seektrain.config.loader import ConfigError, config_to_dict, config_to_toml, load_config, validate
from seektrain.config.schema import JobConfig

__all__ = ["ConfigError", "JobConfig", "config_to_dict", "config_to_toml", "load_config", "validate"]
