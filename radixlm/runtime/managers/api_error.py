"""The error a client sees: an HTTP status and OpenAI's ``{"error": {...}}`` body."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error for the HTTP client, rendered as OpenAI's ``{"error": {...}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code if code is not None else str(status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
