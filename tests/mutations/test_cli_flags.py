"""`add_argument(parser, ..., envvar=...)`: a flag whose default is an environment variable
(cv_mutations/cli_flags.py), as every command declares them (docs/configuration.md)."""

from __future__ import annotations

import argparse
from typing import NoReturn

import pytest

from cv_mutations.cli_flags import add_argument


class _Refused(Exception):
    """What the parser's usage error raised, instead of printing it and exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _Refused(message)


def _parser(**kwargs: object) -> argparse.ArgumentParser:
    parser = _Parser(prog="cmd")
    add_argument(parser, "--port", envvar="CV_T_PORT", help="the port", **kwargs)
    return parser


def test_the_variable_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CV_T_PORT", "9000")
    assert _parser(type=int, default=8080).parse_args([]).port == 9000


def test_the_default_stands_when_the_variable_is_unset_or_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CV_T_PORT", raising=False)
    assert _parser(type=int, default=8080).parse_args([]).port == 8080
    monkeypatch.setenv("CV_T_PORT", "")
    assert _parser(type=int, default=8080).parse_args([]).port == 8080


def test_the_flag_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CV_T_PORT", "9000")
    assert _parser(type=int).parse_args(["--port", "7000"]).port == 7000


def test_the_flag_wins_over_a_variable_that_does_not_parse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CV_T_PORT", "http")
    assert _parser(type=int).parse_args(["--port", "7000"]).port == 7000


def test_a_subcommands_flag_reads_the_variable_too(monkeypatch: pytest.MonkeyPatch) -> None:
    def parser() -> argparse.ArgumentParser:
        top = _Parser(prog="cmd")
        serve = top.add_subparsers(dest="command").add_parser("serve")
        add_argument(serve, "--port", envvar="CV_T_PORT", type=int, help="the port")
        return top

    monkeypatch.setenv("CV_T_PORT", "9000")
    assert parser().parse_args(["serve"]).port == 9000
    monkeypatch.setenv("CV_T_PORT", "http")
    with pytest.raises(_Refused, match=r"\$CV_T_PORT"):
        parser().parse_args(["serve"])


def test_a_value_without_a_type_is_a_plain_string(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CV_T_PORT", "9000")
    value = _parser().parse_args([]).port
    assert (type(value), value) == (str, "9000")


def test_the_help_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CV_T_PORT", raising=False)
    parser = _parser(type=int)
    (action,) = [a for a in parser._actions if a.dest == "port"]
    assert action.help == "the port (env: CV_T_PORT)"
    assert "(env: CV_T_PORT)" in " ".join(parser.format_help().split())


def test_a_flag_without_help_still_names_the_variable() -> None:
    parser = _Parser(prog="cmd")
    assert add_argument(parser, "--url", envvar="CV_T_URL").help == "(env: CV_T_URL)"


def test_a_variable_that_does_not_parse_is_a_usage_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CV_T_PORT", "http")
    with pytest.raises(_Refused) as refused:
        _parser(type=int).parse_args([])
    assert str(refused.value) == "argument --port: invalid int value in $CV_T_PORT: 'http'"


def test_a_float_that_does_not_parse_is_a_usage_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CV_T_PORT", "soon")
    with pytest.raises(_Refused, match=r"invalid float value in \$CV_T_PORT: 'soon'"):
        _parser(type=float).parse_args([])


def test_the_types_own_refusal_is_kept_and_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def port(raw: str) -> int:
        if not 0 <= int(raw) <= 65535:
            raise argparse.ArgumentTypeError(f"{raw} is not within 0..65535")
        return int(raw)

    monkeypatch.setenv("CV_T_PORT", "99999")
    with pytest.raises(_Refused) as refused:
        _parser(type=port).parse_args([])
    assert str(refused.value) == "argument --port: $CV_T_PORT: 99999 is not within 0..65535"


def test_a_variable_outside_the_choices_is_a_usage_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """argparse checks `choices` for a command-line value only, never for a default."""
    monkeypatch.setenv("CV_T_PORT", "xml")
    with pytest.raises(_Refused) as refused:
        _parser(choices=["text", "json"]).parse_args([])
    assert str(refused.value) == (
        "argument --port: invalid choice in $CV_T_PORT: 'xml' (choose from 'text', 'json')"
    )
    monkeypatch.setenv("CV_T_PORT", "json")
    assert _parser(choices=["text", "json"]).parse_args([]).port == "json"


def test_a_command_line_value_keeps_argparses_own_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CV_T_PORT", "9000")
    with pytest.raises(_Refused) as refused:
        _parser(type=int).parse_args(["--port", "http"])
    assert str(refused.value) == "argument --port: invalid int value: 'http'"


def test_a_required_flag_is_satisfied_by_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CV_T_PORT", "9000")
    assert _parser(required=True).parse_args([]).port == "9000"
    monkeypatch.delenv("CV_T_PORT")
    with pytest.raises(_Refused, match="--port"):
        _parser(required=True).parse_args([])


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("TRUE", True), ("yes", True), ("On", True), ("0", False), ("off", False)],
)
@pytest.mark.parametrize("action", ["store_true", argparse.BooleanOptionalAction])
def test_a_boolean_flag_reads_the_variable_as_a_boolean(
    monkeypatch: pytest.MonkeyPatch, action: object, raw: str, expected: bool
) -> None:
    monkeypatch.setenv("CV_T_FLAG", raw)
    parser = _Parser(prog="cmd")
    add_argument(parser, "--flag", envvar="CV_T_FLAG", action=action, help="a switch")
    assert parser.parse_args([]).flag is expected
    assert parser.parse_args(["--flag"]).flag is True


def test_a_boolean_variable_that_does_not_parse_is_a_usage_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CV_T_FLAG", "maybe")
    parser = _Parser(prog="cmd")
    add_argument(parser, "--flag", envvar="CV_T_FLAG", action="store_true", help="a switch")
    with pytest.raises(_Refused) as refused:
        parser.parse_args([])
    assert str(refused.value) == (
        "argument --flag: $CV_T_FLAG: not a boolean: 'maybe' (1/0, true/false, yes/no, on/off)"
    )
    assert parser.parse_args(["--flag"]).flag is True


def test_a_bad_variable_does_not_break_help(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CV_T_PORT", "http")
    with pytest.raises(SystemExit) as done:
        _parser(type=int).parse_args(["--help"])
    assert done.value.code == 0
    assert "(env: CV_T_PORT)" in capsys.readouterr().out


def test_the_real_parser_exits_2_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CV_T_PORT", "http")
    parser = argparse.ArgumentParser(prog="cmd")
    add_argument(parser, "--port", envvar="CV_T_PORT", type=int, help="the port")
    with pytest.raises(SystemExit) as done:
        parser.parse_args([])
    assert done.value.code == 2
    assert "cmd: error: argument --port: invalid int value in $CV_T_PORT: 'http'" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("kwargs", [{"action": "append"}, {"action": "count"}, {"nargs": "+"}])
def test_a_flag_of_many_values_cannot_be_backed_by_a_variable(kwargs: dict[str, object]) -> None:
    with pytest.raises(TypeError, match="CV_T_MANY"):
        add_argument(_Parser(prog="cmd"), "--many", envvar="CV_T_MANY", **kwargs)
