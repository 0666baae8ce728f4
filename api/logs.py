"""Log records as plain text lines or as one JSON object per line (``--log-format json``).

The same configuration is handed to uvicorn, so its own loggers (``uvicorn.error``,
``uvicorn.access``) write in the chosen format too.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import msgspec

__all__ = ["JsonFormatter", "log_config"]

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is emitted, but
# for uvicorn's ``color_message`` (the message again, with ANSI colour codes for its own formatter).
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",
}
# uvicorn's access line (and `api.protocol`'s, in the same shape) is '%s - "%s %s HTTP/%s" %d' over
# these arguments: in JSON they are fields of their own.
_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")
_encode = msgspec.json.Encoder(enc_hook=str).encode


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the ``extra`` fields, any traceback;
    access lines also as ``client``, ``method``, ``path``, ``http_version`` and ``status``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            entry.update(zip(_ACCESS_FIELDS, record.args, strict=True))
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return _encode(entry).decode()


def log_config(level: str, fmt: Literal["text", "json"]) -> dict[str, Any]:
    """A `logging.config.dictConfig` for our loggers and uvicorn's, writing to stderr."""
    formatter: dict[str, Any] = (
        {"()": JsonFormatter}
        if fmt == "json"
        else {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s", "datefmt": "%Y-%m-%dT%H:%M:%S"}
    )
    handler = {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"}
    upper = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": formatter},
        "handlers": {"default": handler},
        "loggers": {
            "": {"handlers": ["default"], "level": upper},
            "uvicorn": {"handlers": [], "level": upper, "propagate": True},
            "uvicorn.error": {"handlers": [], "level": upper, "propagate": True},
            "uvicorn.access": {"handlers": [], "level": upper, "propagate": True},
        },
    }
