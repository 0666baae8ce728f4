"""The installed package's version, for --version, the OpenAPI document and build-info metrics."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["package_version"]


def package_version() -> str:
    try:
        return version("kv-router")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"
