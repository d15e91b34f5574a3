"""What the three commands share: `--version`, help on every flag naming its environment
variable, the exit statuses in `--help`, one error style (a line of text, or JSON with `--json`),
`--workspace` wherever a workspace is meant, and configuration errors that fail at once."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token
from cv_server.cli import _parser as server_parser
from cv_workspace_client._queue import requester as api
from cv_workspace_client.cli.conventions import EXIT_USAGE
from cv_workspace_client.cli.worker import _worker_parser
from cv_workspace_client.cli.workspace import _warnings_to_stderr, _workspace_parser, workspace_main
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import ConnectionFailedError
from tests.acceptance.procs import free_port
from tests.worker.conftest import SECRET, WS, token_for, url_of

BOUND = 60.0

COMMANDS = {
    "cv-server": [sys.executable, "-m", "cv_server._entry"],
    "cv-worker": [sys.executable, "-m", "cv_workspace_client.cli", "worker"],
    "cv-workspace": [sys.executable, "-m", "cv_workspace_client.cli", "workspace"],
}


@pytest.mark.parametrize("prog", sorted(COMMANDS))
def test_every_command_prints_its_version(prog: str) -> None:
    done = subprocess.run(
        [*COMMANDS[prog], "--version"], capture_output=True, text=True, timeout=BOUND
    )
    assert (done.returncode, done.stdout) == (0, f"{prog} {version('cv-workspace')}\n")


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`parser` and every sub-command's parser below it."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


ALL_PARSERS = [
    *_parsers(server_parser()),
    *_parsers(_worker_parser()),
    *_parsers(_workspace_parser()),
]

#: Flags whose value may come from the environment, and the variable their help must name.
ENVIRONMENT = {
    "--url": "CV_URL",
    "--token": "CV_TOKEN",
    "--token-file": "CV_TOKEN_FILE",
    "--workspace": "CV_WORKSPACE",
    "--db": "CV_DB",
    "--database-url": "CV_DATABASE_URL",
    "--schema": "CV_SCHEMA",
    "--host": "CV_HOST",
    "--port": "CV_PORT",
    "--log-level": "CV_LOG_LEVEL",
    "--log-format": "CV_LOG_FORMAT",
    "--stages": "CV_STAGES",
    "--worker-class": "CV_WORKER_CLASS",
    "--worker-id": "CV_WORKER_ID",
    "--concurrency": "CV_CONCURRENCY",
    "--provider": "CV_PROVIDER",
    "--provider-url": "CV_PROVIDER_URL",
    "--model": "CV_MODEL",
    "--outbox": "CV_OUTBOX",
    "--transport": "CV_MCP_TRANSPORT",
}

#: Flags whose variable is their command's own: `cv-workspace mcp` listens beside `cv-server serve`
#: (docs/configuration.md#ports), so one shell can set both ports.
ENVIRONMENT_OF = {
    ("cv-workspace mcp", "--host"): "CV_MCP_HOST",
    ("cv-workspace mcp", "--port"): "CV_MCP_PORT",
    ("cv-worker", "--transport"): "CV_WORKER_TRANSPORT",  # the worker's, not the MCP server's
}

#: Flags of those names that mean something else where they are, and read no variable: the
#: workspaces a token grants, the worker class a request asks for.
NOT_FROM_ENVIRONMENT = {
    ("cv-server token", "--workspace"),
    ("cv-workspace enqueue", "--worker-class"),
    ("cv-workspace requests rerun", "--worker-class"),
    ("cv-workspace schedules add", "--worker-class"),
}

#: The environment variable named by the help of a flag backed by one (cv_mutations/cli_flags.py).
_NAMED = re.compile(r"\(env: (CV_[A-Z_]+)\)$")


@pytest.mark.parametrize("parser", ALL_PARSERS, ids=lambda p: p.prog)
def test_every_flag_has_help_and_every_help_lists_the_exit_statuses(
    parser: argparse.ArgumentParser,
) -> None:
    assert parser.epilog is not None
    assert "exit status:" in parser.epilog
    assert " 2 " in parser.epilog.replace("\n", " ")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        assert action.help, f"{parser.prog} {action.option_strings or action.dest} has no help"
        for flag in action.option_strings:
            if flag in ENVIRONMENT and (parser.prog, flag) not in NOT_FROM_ENVIRONMENT:
                variable = ENVIRONMENT_OF.get((parser.prog, flag), ENVIRONMENT[flag])
                assert action.help.endswith(f"(env: {variable})"), f"{parser.prog} {flag}"


def _variables_in_help() -> set[str]:
    return {
        named[1]
        for parser in ALL_PARSERS
        for action in parser._actions
        if action.help and (named := _NAMED.search(action.help))
    }


def test_every_variable_a_flag_reads_is_in_the_configuration_docs() -> None:
    """The table of docs/configuration.md lists the variables the commands' flags read, and the
    provider's API key, which has no flag (`ps` would show it)."""
    docs = Path(__file__).parents[2] / "docs" / "configuration.md"
    rows = re.findall(r"^  \| (`CV_[^|]+)\|", docs.read_text(encoding="utf-8"), re.MULTILINE)
    documented = {name for row in rows for name in re.findall(r"`(CV_[A-Z_]+)`", row)}
    assert documented == _variables_in_help() | {"CV_PROVIDER_API_KEY"}
    assert _variables_in_help() == set(ENVIRONMENT.values()) | set(ENVIRONMENT_OF.values())


def test_the_server_takes_its_settings_from_the_environment(tmp_path: Path) -> None:
    db = tmp_path / "from-env.db"
    env = {"CV_DB": str(db), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [*COMMANDS["cv-server"], "init"], capture_output=True, text=True, timeout=BOUND, env=env
    )
    assert done.returncode == 0, done.stderr
    assert db.is_file()
    refused = subprocess.run(
        [*COMMANDS["cv-server"], "serve"],
        capture_output=True,
        text=True,
        timeout=BOUND,
        env={**env, "CV_PORT": "not-a-port"},
    )
    assert refused.returncode == EXIT_USAGE
    assert "--port" in refused.stderr


async def test_an_error_is_one_line_of_text_and_json_with_the_flag(
    capsys: pytest.CaptureFixture[str], server: TestServer
) -> None:
    argv = ["enqueue", "--workspace", WS, "--stage", "s", "--input", "{nope"]
    argv += ["--url", url_of(server), "--token", token_for(WS)]
    assert await asyncio.to_thread(workspace_main, argv) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("cv-workspace: --input is not JSON")
    assert await asyncio.to_thread(workspace_main, [*argv, "--json"]) == EXIT_USAGE
    error = json.loads(capsys.readouterr().err)["error"]
    assert error["code"] == "usage"
    assert error["message"].startswith("--input is not JSON")

    other = ["requests", "show", "--workspace", "other-ws", "d_x"]
    other += ["--url", url_of(server), "--token", token_for(WS)]
    assert await asyncio.to_thread(workspace_main, other) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("cv-workspace: ")
    assert err.rstrip().endswith("(forbidden_workspace)")


async def test_listing_without_a_workspace_names_the_flag(
    capsys: pytest.CaptureFixture[str], server: TestServer
) -> None:
    argv = ["requests", "list", "--url", url_of(server), "--token", token_for(WS)]
    assert await asyncio.to_thread(workspace_main, argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--workspace" in err
    assert "?workspace=" not in err


@pytest.mark.parametrize("verb", ["show", "wait", "replay"])
def test_request_verbs_take_the_workspace_as_a_flag(verb: str) -> None:
    args = _workspace_parser().parse_args(["requests", verb, "--workspace", WS, "d_x"])
    assert (args.workspace, args.request_id) == (WS, "d_x")


async def test_every_retry_of_a_call_to_an_unreachable_server_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A call that waits out a server that does not answer is never silent: each retry is a
    warning, which `cv-workspace` prints on stderr as it happens."""
    config = ClientConfig(retry_base_seconds=0.001, retry_cap_seconds=0.01, retry_attempts=4)
    dead = f"http://127.0.0.1:{free_port()}"
    caplog.set_level(logging.WARNING, logger="cv_workspace_client.retry")
    async with api.QueueClient(dead, token_for(WS), config=config) as qc:
        with pytest.raises(ConnectionFailedError):
            await qc.enqueue(WS, stage="s", job_id="J1")
    said = [r.getMessage() for r in caplog.records if r.name == "cv_workspace_client.retry"]
    assert [line.split("; try ")[1].split(" in ")[0] for line in said] == [
        "2 of 4",
        "3 of 4",
        "4 of 4",
    ]
    assert all("connection" in line.lower() for line in said)


def test_the_retry_warnings_reach_stderr_in_the_commands_style(
    capsys: pytest.CaptureFixture[str],
) -> None:
    handler = _warnings_to_stderr()
    try:
        logging.getLogger("cv_workspace_client.retry").warning("refused; try 2 of 5 in 1.0 s")
    finally:
        logging.getLogger("cv_workspace_client").removeHandler(handler)
    assert capsys.readouterr().err == "cv-workspace: refused; try 2 of 5 in 1.0 s\n"


async def test_the_worker_is_ready_only_once_its_server_answers(
    aiohttp_server: object, tmp_path: Path
) -> None:
    """Pointed at a server that is not there (yet), the worker says so on stderr and keeps
    trying; `ready` comes once the server answers, and a drain then ends it with exit 0."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *COMMANDS["cv-worker"], "--url", f"http://127.0.0.1:{port}", "--token", token_for(WS),
        "--stages", "tests.worker.cli_stages:STAGES", "--worker-id", "patient",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(BOUND):
            while b"waiting for the server" not in (line := await proc.stderr.readline()):
                assert line, "the worker exited without saying why it waits"
        assert not proc.stdout._buffer  # type: ignore[attr-defined]  # no `ready` yet
        app = create_app(ServerConfig(db_path=tmp_path / "late.db", token_secret=SECRET))
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with asyncio.timeout(BOUND):
                assert await proc.stdout.readline() == b"cv-worker patient ready\n"
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(BOUND):
                assert await proc.wait() == 0
        finally:
            await runner.cleanup()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_missing_scope_is_named_in_the_error(
    capsys: pytest.CaptureFixture[str], server: TestServer
) -> None:
    read_only = mint_token(SECRET, [WS], now=time.time(), scopes=["read"])
    argv = ["enqueue", "--workspace", WS, "--stage", "s"]
    argv += ["--url", url_of(server), "--token", read_only]
    assert await asyncio.to_thread(workspace_main, argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "the token needs the enqueue scope" in err
    assert err.rstrip().endswith("(missing_scope)")
    assert await asyncio.to_thread(workspace_main, [*argv, "--json"]) == 1
    error = json.loads(capsys.readouterr().err)["error"]
    assert error["code"] == "missing_scope"
    assert error["required_scopes"] == ["enqueue"]
