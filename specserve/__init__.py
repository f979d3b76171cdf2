"""specserve: an OpenAI-compatible inference server with lossless speculative decoding.

The repository keeps the design card's top-level folders; they install under this one namespace
(pyproject.toml's package-dir): specserve.config, specserve.engine, specserve.server, specserve.train."""

__version__ = "0.1.0"
