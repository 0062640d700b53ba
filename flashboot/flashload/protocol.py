"""The served-load socket's errors: a failure travels as JSON and is raised again with its class."""

from __future__ import annotations

from .. import errors as _errors
from ..errors import (
    FlashBootError,
)


def _error_payload(exc: BaseException) -> dict:
    attrs = {k: v for k, v in vars(exc).items() if isinstance(v, (int, float, str, bool, type(None)))}
    return {"ok": False, "error": type(exc).__name__, "message": str(exc), "attrs": attrs}


def _raise_remote(reply: dict, who: str) -> None:
    cls = getattr(_errors, reply.get("error", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, FlashBootError)):
        cls = FlashBootError
    exc = cls.__new__(cls)
    Exception.__init__(exc, f"{who}: {reply.get('message', 'failed')}")
    exc.__dict__.update(reply.get("attrs") or {})
    raise exc

