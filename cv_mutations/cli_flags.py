"""Command-line flags backed by an environment variable: `add_argument(parser, "--url",
envvar="CV_URL", help=...)` declares one, for `cv-server`, `cv-worker` and `cv-workspace` alike.

The variable is the flag's default, a flag given on the command line wins over it, and the help
ends with `(env: CV_URL)`, so `--help` names every variable (docs/configuration.md lists them).
An empty variable counts as unset (`CV_PORT= cv-server serve` is how a shell unsets one for a
command). A value that does not parse (`CV_PORT=http`, `CV_PROVIDER=bogus`) is the parser's usage
error, exit 2, naming the flag and the variable; it is checked only when the flag is not given,
so a bad variable neither breaks `--help` nor outvotes the flag that overrides it.

Here, in `cv_mutations`, because both the SDK's commands and the server's declare such flags and
`cv_mutations` is the one package both import (the SDK and the server never import each other:
[tool.importlinter] in pyproject.toml), as `cv_mutations.logs` is. Standard library only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

__all__ = ["add_argument"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_BOOLEAN_ACTIONS: tuple[object, ...] = ("store_true", argparse.BooleanOptionalAction)


class _FromEnvironment(str):
    """A default read from the environment. argparse converts a string default with the flag's
    `type` only when the flag was not given, and passes the default object itself: this class is
    how the converter tells the variable's value from a command-line one, and names the former."""

    __slots__ = ()


def add_argument(
    parser: argparse.ArgumentParser, *flags: str, envvar: str, **kwargs: Any
) -> argparse.Action:
    """Declare the flag `flags` on `parser` (as `parser.add_argument(*flags, **kwargs)`), with
    the environment variable `envvar` as its default and `(env: ENVVAR)` at the end of its help.

    Call it while building the parser: the variable is read then. A flag that takes one value
    (the default action, with any `type` and `choices`) gets the variable's value converted and
    checked like a command-line one; a `store_true` or `argparse.BooleanOptionalAction` flag
    reads it as a boolean (1/0, true/false, yes/no, on/off, in any case). A `required` flag is
    satisfied by the variable. `default` stays the default when the variable is unset or empty.

    Raises:
        TypeError: if the flag's action is not one of those (`append`, `count`, ...), or
            `nargs` is given: a variable holds one value.
    """
    action_kind = kwargs.get("action")
    boolean = action_kind in _BOOLEAN_ACTIONS
    if not (boolean or action_kind in (None, "store")) or "nargs" in kwargs:
        raise TypeError(f"{envvar}: an environment variable backs a one-value or boolean flag")
    help_text = kwargs.get("help")
    if help_text != argparse.SUPPRESS:
        kwargs["help"] = f"{help_text} (env: {envvar})" if help_text else f"(env: {envvar})"
    raw = os.environ.get(envvar)
    if raw:
        kwargs["default"] = _FromEnvironment(raw)
        kwargs["required"] = False
    action = parser.add_argument(*flags, **kwargs)
    if raw:
        base = _parse_bool if boolean else action.type
        if base is not None and not callable(base):  # a type name registered with argparse
            raise TypeError(f"{envvar}: the flag's type must be a callable, not {base!r}")
        choices = None if action.choices is None else list(action.choices)
        action.type = _converter(envvar, base, choices)
    return action


def _converter(
    envvar: str, base: Callable[[str], Any] | None, choices: list[Any] | None
) -> Callable[[str], Any]:
    """The flag's `type`, as argparse calls it: a command-line value goes to `base` untouched
    (argparse words its own errors); the variable's value is converted and checked against
    `choices` (which argparse skips for a default), its errors naming the variable
    (tests/mutations/test_cli_flags.py)."""

    def convert(text: str) -> Any:
        if not isinstance(text, _FromEnvironment):
            return text if base is None else base(text)
        value = str(text)
        try:
            converted = value if base is None else base(value)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"${envvar}: {exc}") from None
        except (TypeError, ValueError):
            name = getattr(base, "__name__", repr(base))
            raise argparse.ArgumentTypeError(
                f"invalid {name} value in ${envvar}: {value!r}"
            ) from None
        if choices is not None and converted not in choices:
            listed = ", ".join(repr(choice) for choice in choices)
            raise argparse.ArgumentTypeError(
                f"invalid choice in ${envvar}: {value!r} (choose from {listed})"
            )
        return converted

    convert.__name__ = getattr(base, "__name__", "str")
    return convert


def _parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r} (1/0, true/false, yes/no, on/off)")
