"""`cv-worker --stages pkg.module:STAGES`: the user's stages module, imported as `python -m` would
find it (the current directory first), and in one line why it could not be (docs/stages.md).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback
from collections.abc import Mapping

from cv_workspace_client.cli.conventions import UsageError
from cv_workspace_client.stage import Handler, Stage

__all__ = ["load_stages"]


def _current_directory_on_path() -> str | None:
    """Put the current directory first on `sys.path`, as `python -m` and uvicorn do, and return
    it. The `cv-worker` console script is run as a file, so Python put the script's directory
    there instead (`.venv/bin`): a stages module next to the user, as the README has it, was
    "No module named". Left there (uvicorn's way, not celery's import-time-only one): a stage
    that imports a sibling module only when it first runs must find it too. Not under `python
    -P` / `PYTHONSAFEPATH`, which ask for no such entry; nor when the directory is gone."""
    if sys.flags.safe_path:
        return None
    try:
        cwd = os.getcwd()
    except FileNotFoundError:
        return None
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    return cwd


def _import_failure(module_name: str, exc: Exception, cwd: str | None) -> UsageError:
    """Why `--stages` could not be imported, in one line: a module that is not there (a wrong
    name, or another directory), or one that failed while it ran (its own bug, or a dependency
    it lacks: named with the file and line; the traceback under --log-level DEBUG). A
    SyntaxError or an exception the module raised was a traceback with exit 1."""
    if isinstance(exc, ModuleNotFoundError) and (
        exc.name == module_name or module_name.startswith(f"{exc.name}.")
    ):
        where = f"in the current directory ({cwd}) nor " if cwd else ""
        hint = (
            f" (a module name, not a file: {module_name[:-3]})"
            if module_name.endswith(".py")
            else ""
        )
        return UsageError(f"--stages: {exc}: not {where}on the Python path{hint}")
    logging.getLogger(__name__).debug("importing %s failed", module_name, exc_info=exc)
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__)
    if frames and not isinstance(exc, SyntaxError):  # a SyntaxError names its file and line
        what += f" ({frames[-1].filename}, line {frames[-1].lineno})"
    return UsageError(f"--stages: importing {module_name!r} failed: {what}")


def load_stages(spec: str) -> dict[str, Handler | Stage]:
    """Import `pkg.module:NAME`, a dict of stage name → handler or `Stage`. The module is looked
    for in the current directory first, as `python -m` does; this puts that directory on
    `sys.path` (see `_current_directory_on_path`)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr or not all(part.isidentifier() for part in module_name.split(".")):
        # `./mymod:STAGES`, `.mymod:STAGES` (a relative name was a TypeError traceback).
        raise UsageError(f"--stages must look like pkg.module:NAME, not {spec!r}")
    cwd = _current_directory_on_path()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # anything the module raises while it runs: its own bug
        raise _import_failure(module_name, exc, cwd) from None
    stages = getattr(module, attr, None)
    if not isinstance(stages, Mapping) or not stages:
        raise UsageError(f"{spec} must be a non-empty dict of stage name -> handler or Stage")
    for name, stage in stages.items():
        if not isinstance(name, str) or not (isinstance(stage, Stage) or callable(stage)):
            raise UsageError(f"{spec}[{name!r}] must be a handler or a Stage")
    return dict(stages)
