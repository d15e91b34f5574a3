"""The installed distribution's version: what `--version` prints and what the MCP server
answers as `serverInfo.version` (a leaf: the CLI and the MCP server both import it)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["package_version"]


def package_version() -> str:
    """The installed `cv-workspace` distribution's version (`unknown` when run from a checkout
    that was never installed)."""
    try:
        return version("cv-workspace")
    except PackageNotFoundError:
        return "unknown"
