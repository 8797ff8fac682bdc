"""Errors the engine raises at its boundary.

Each carries a message that names the offending value, so `serve` can return it as is.
"""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request or its sampling parameters cannot be served; other requests are unaffected.

    `param` names the request field at fault, when one is, for an HTTP 400's `param`.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(EngineError, RuntimeError):
    """A model file or directory is missing, corrupt, or of an unsupported kind."""


class MemoryBudgetError(EngineError, RuntimeError):
    """The model weights plus the smallest usable KV cache do not fit in the memory budget."""
