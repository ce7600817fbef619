"""The error of a request that can never run, naming the field that was wrong (`param`), so the
server can answer OpenAI's `{"param": ...}` without reading it out of the message."""

from __future__ import annotations


class RequestError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
