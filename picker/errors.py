"""Exception hierarchy.

```
Exception
 ├── ConfigError                 start-up and reload: names the file, plugin and field
 └── PickerError                 per request; only handlers/ maps these to HTTP responses
      ├── RequestError           the client's fault (4xx)
      │    ├── BadRequestError        400 malformed body, missing model
      │    ├── ModelNotFoundError     404 model not served by the pool
      │    └── BodyTooLargeError      413 body over the configured limit
      ├── CapacityError          the pool's state (429/503)
      │    ├── SaturatedError         429 shed or every endpoint filtered out
      │    └── NoEndpointsError       503 no ready endpoint
      └── InternalError          500 a bug or an unexpected state
```
"""

from __future__ import annotations


class ConfigError(Exception):
    """An invalid configuration; the message names the file, plugin and field."""


class PickerError(Exception):
    """A request could not be scheduled.

    Attributes:
        status: HTTP status code Envoy returns to the client.
        reason: short machine-readable reason, sent in the dropped-reason header.
        error_type: OpenAI-style error type for the JSON body.
    """

    status = 500
    reason = "internal-error"
    error_type = "internal_error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason


class RequestError(PickerError):
    status = 400
    reason = "bad-request"
    error_type = "invalid_request_error"


class BadRequestError(RequestError):
    pass


class ModelNotFoundError(RequestError):
    status = 404
    reason = "model-not-found"
    error_type = "not_found_error"


class BodyTooLargeError(RequestError):
    status = 413
    reason = "body-too-large"


class CapacityError(PickerError):
    status = 503
    reason = "rejected-no-endpoints"
    error_type = "service_unavailable"


class SaturatedError(CapacityError):
    status = 429
    reason = "rejected-saturated"
    error_type = "rate_limit_exceeded"


class NoEndpointsError(CapacityError):
    pass


class OverloadedError(CapacityError):
    """The picker itself is behind: too many requests wait to be scheduled."""

    reason = "overloaded"


class InternalError(PickerError):
    pass
