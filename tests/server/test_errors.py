"""The server has one exception root, `cv_server.errors.CvServerError`, and its tree is drawn in
that module's docstring: an exception class of the server outside the tree fails here."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import cv_server
import cv_server.errors
from cv_server.errors import CvServerError


def server_exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of `cv_server`, by qualified name."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(cv_server.__path__, "cv_server."):
        module = importlib.import_module(info.name)
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__ == info.name:
                found[f"{info.name}.{value.__qualname__}"] = value
    return found


def test_every_exception_class_of_the_server_is_a_cv_server_error() -> None:
    classes = server_exception_classes()
    assert len(classes) >= 15  # the walk saw the whole package
    outside = sorted(name for name, cls in classes.items() if not issubclass(cls, CvServerError))
    assert outside == []


def test_the_tree_in_the_errors_docstring_names_every_public_exception_class() -> None:
    tree = cv_server.errors.__doc__ or ""
    public = {cls.__name__ for cls in server_exception_classes().values()}
    public = {name for name in public if not name.startswith("_")}
    assert sorted(name for name in public if name not in tree) == []


def test_the_seams_errors_are_one_family() -> None:
    from cv_server.auth import TokenError
    from cv_server.http.problems import Problem
    from cv_server.oplog import OpLogCorrupted
    from cv_server.pg.errors import PostgresBackendError
    from cv_server.queue import QueueError
    from cv_server.stores import DatabaseUnusable

    roots = [
        TokenError,
        Problem,
        OpLogCorrupted,
        PostgresBackendError,
        QueueError,
        DatabaseUnusable,
    ]
    assert all(root.__mro__[1] is CvServerError for root in roots)
