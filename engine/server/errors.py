"""The error every request check raises: OpenAI's error shape (`ApiError.body`)."""
from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the server refuses: HTTP status, message, and the field at fault."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             403: "permission_error", 405: "invalid_request_error", 413: "invalid_request_error",
             415: "invalid_request_error", 503: "server_busy",
             500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}
