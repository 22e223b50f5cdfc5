"""The one exception handlers raise for a client-visible error; write_error renders its detail."""
from tornado.web import HTTPError


class APIError(HTTPError):
    """An HTTP error whose JSON body is ``{"detail": detail}``, with optional extra headers."""

    def __init__(self, status_code: int, detail: str, headers: dict[str, str] | None = None, code: str | None = None):
        # "%s" keeps a detail with a percent sign from breaking Tornado's log formatting.
        super().__init__(status_code, "%s", detail)
        self.detail = detail
        self.headers = headers or {}
        self.code = code  # a machine-readable reason, for the APIs whose error shape has one


def invalid(reason: str, status_code: int = 400) -> APIError:
    return APIError(status_code, f"Invalid request: {reason}")
