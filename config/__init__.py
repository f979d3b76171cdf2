"""One typed configuration tree, built once and passed down."""

from specserve.config.schema import AppConfig, EngineConfig, ServerConfig

__all__ = ["AppConfig", "EngineConfig", "ServerConfig"]
