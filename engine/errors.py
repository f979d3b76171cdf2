"""Typed engine errors; the server maps each to an HTTP status (400 / 429 / 503)."""


class EngineError(Exception):
    """Base class of errors the engine raises to its callers."""


class InvalidRequestError(EngineError, ValueError):
    """A request parameter the engine cannot honour; `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class RequestTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) can never fit the model length or the KV cache."""

    def __init__(self, message: str, param: str | None = "prompt"):
        super().__init__(message, param=param, code="context_length_exceeded")


class QueueFullError(EngineError):
    """The waiting queue holds max_queue_len requests: retry later (HTTP 429)."""


class EngineDeadError(EngineError):
    """The engine loop stopped after a fatal error or shutdown (HTTP 503)."""
