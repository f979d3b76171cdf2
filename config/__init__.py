"""One typed configuration tree, built once and passed down."""

from config.schema import EngineConfig

__all__ = ["EngineConfig"]
