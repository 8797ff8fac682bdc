"""How a request can fail past the HTTP layer, each with the HTTP status it maps to."""

from __future__ import annotations


class InferenceError(RuntimeError):
    """A request failed in the engine; `status_code` is the HTTP status it maps to."""

    status_code = 503


class EngineUnavailable(InferenceError):
    """No worker can take the request, or its worker went away and none can continue it."""


class RequestRejected(InferenceError):
    """The engine's own validation refused the request."""

    status_code = 400


class DrainRefused(InferenceError):
    """Removing the worker would overload the others, or there is no such worker."""

    status_code = 409


class RequestStalled(InferenceError):
    """The engine's watchdog ended the request: the step loop had stopped advancing it."""


class EngineFailedRequest(InferenceError):
    """The worker's engine raised on the request; the request ended, the worker serves on."""

    status_code = 500


class RequestCrashedWorkers(InferenceError):
    """The request was in flight at too many worker crashes: it is failed, not retried,
    so that it cannot take down every worker in turn."""

    status_code = 500


class DeadlineExceeded(InferenceError):
    """The request ran past its deadline (--request-timeout)."""

    status_code = 408
