"""`cv-workspace` and `cv-worker` as an operator runs them: piped into a reader that leaves early
(`| head -1`), given arguments that cannot work, interrupted mid-wait, asked for `--help`.

Real processes against the in-process server of `conftest.py`, except where an argument is
refused before anything is sent (then in-process, as `test_commands.py` does)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from cv_server.keys import WAITERS
from cv_workspace_client import WorkspaceClient
from cv_workspace_client._queue import requester as api
from cv_workspace_client.cli.__main__ import main
from cv_workspace_client.cli.conventions import EXIT_USAGE
from cv_workspace_client.cli.worker import worker_main
from cv_workspace_client.cli.workspace import workspace_main
from cv_workspace_client.stage import Handler, Stage, StageContext
from cv_workspace_client.stages import demo
from cv_workspace_client.testing import FaultProxy
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.cli.test_edges import _worker_process
from tests.worker.cli_stages import STAGES as DOUBLE_STAGES
from tests.worker.conftest import (
    WS,
    MakeServer,
    fast_client_config,
    long_polls_registered,
    running,
    token_for,
    url_of,
)

FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)
#: What a shell reports for a program that died of SIGPIPE, and what the commands now exit with
#: when their reader left: 128 + SIGPIPE.
EXIT_READER_GONE = 128 + signal.SIGPIPE


def _command(program: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "cv_workspace_client.cli", program, *args, "--json"]


def _auth(server: TestServer) -> tuple[str, ...]:
    return ("--url", url_of(server), "--token", token_for(WS))


async def _finish(proc: asyncio.subprocess.Process, within: float = 60) -> tuple[int, str, str]:
    try:
        out, err = await asyncio.wait_for(proc.communicate(), within)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, (out or b"").decode(), (err or b"").decode()


async def _with_reader_gone(argv: list[str]) -> tuple[int, str]:
    """Run `argv` with a stdout pipe whose reader has already left (as after `| head -1`
    exited): every write to it fails with EPIPE. Returns the exit code and stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=write_end, stderr=asyncio.subprocess.PIPE
        )
    finally:
        os.close(write_end)
    code, _, err = await _finish(proc)
    return code, err


async def _boom(ctx: StageContext) -> Any:
    raise RuntimeError("boom")


# -- a reader that leaves early --------------------------------------------------------------------


async def test_requests_list_piped_into_head_exits_quietly_when_the_reader_leaves(
    server: TestServer,
) -> None:
    """`cv-workspace requests list | head -1`: head reads one line and exits while the command
    is still writing. It ended in a BrokenPipeError traceback (exit 1)."""
    async with api.QueueClient(url_of(server), token_for(WS)) as qc:
        # An answer far larger than a pipe holds (64 KiB) plus one read: the command is still
        # writing when the reader leaves, whatever the scheduling.
        await qc.enqueue(WS, stage="s", job_id="J1", input="x" * 512 * 1024)
    read_end, write_end = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            *_command("workspace", "requests", "list", "--workspace", WS, *_auth(server)),
            stdout=write_end,
            stderr=asyncio.subprocess.PIPE,
        )
    finally:
        os.close(write_end)
    try:
        first = await asyncio.to_thread(os.read, read_end, 64 * 1024)
    finally:
        os.close(read_end)  # head -1 is done
    code, _, err = await _finish(proc)
    assert first.startswith(b"{\n")
    assert err == ""
    assert code == EXIT_READER_GONE


async def test_every_command_that_answers_on_stdout_exits_quietly_when_its_reader_is_gone(
    make_server: MakeServer,
) -> None:
    server = await make_server(failure_backoff_seconds=0.0)
    stages: dict[str, Handler | Stage] = {**DOUBLE_STAGES, "boom": _boom}
    async with (
        WorkspaceClient(url_of(server), token=token_for(WS)) as client,
        running(Worker(client, stages, config=FAST)),
    ):
        done = await client.enqueue(WS, stage="double", job_id="J1", input=21)
        poison = await client.enqueue(WS, stage="boom", job_id="J2", max_dequeues=1)
        assert (await client.wait_request(WS, done.request_id, timeout=30)).ok
        assert (await client.wait_request(WS, poison.request_id, timeout=30)).status == "poison"
        commands = [
            ["enqueue", "--workspace", WS, "--stage", "double", "--job-id", "J3", "--input", "1"],
            ["enqueue", "--workspace", WS, "--stage", "double", "--job-id", "J4", "--input", "2",
             "--wait", "--timeout", "30"],
            ["requests", "list", "--workspace", WS],
            ["requests", "list", "--workspace", WS, "--all", "--limit", "1"],
            ["requests", "show", "--workspace", WS, done.request_id],
            ["requests", "wait", "--workspace", WS, done.request_id, "--timeout", "30"],
            ["requests", "replay", "--workspace", WS, poison.request_id],
            ["requests", "rerun", "--workspace", WS, "--stage", "double", "--job-id", "J1",
             "--input", "5"],
        ]  # fmt: skip
        results = await asyncio.gather(
            *(_with_reader_gone(_command("workspace", *c, *_auth(server))) for c in commands)
        )
    for command, (code, err) in zip(commands, results, strict=True):
        assert err == "", (command, err)
        assert code == EXIT_READER_GONE, (command, code)


async def test_help_with_its_reader_gone_exits_without_a_word(server: TestServer) -> None:
    for argv in (_command("workspace", "requests", "list", "--help"), _command("worker", "-h")):
        code, err = await _with_reader_gone(argv)
        assert err == "", (argv, err)
        assert code in (0, EXIT_READER_GONE), (argv, code)


async def test_a_worker_whose_stdout_reader_is_gone_still_works_and_drains(
    server: TestServer,
) -> None:
    """`cv-worker ... | head -1` where head left before the ready line: the worker died of the
    BrokenPipeError (a traceback) before claiming anything. Its ready line is a courtesy; its
    work is the queue."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = await asyncio.create_subprocess_exec(
            *_command("worker", *_auth(server), "--stages", "tests.worker.cli_stages:STAGES",
                      "--log-level", "WARNING"),
            stdout=write_end,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
    finally:
        os.close(write_end)
    try:
        await long_polls_registered(server, 1, within=30)  # claiming: it survived its stdout
        async with api.QueueClient(url_of(server), token_for(WS)) as qc:
            answer = await qc.enqueue(WS, stage="double", job_id="J1", input=21)
            outcome = await qc.wait_request(WS, answer.request_id, timeout=30)
        proc.send_signal(signal.SIGTERM)
    finally:
        code, _, err = await _finish(proc)
    assert outcome.result == 42
    assert "Traceback" not in err
    assert code == 0


# -- arguments that cannot work --------------------------------------------------------------------


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


BAD_WORKSPACE_ARGS: list[tuple[list[str], str]] = [
    (["enqueue", "--stage", "s", "--job-id", "J1", "--input", "NaN"], "--input"),
    (["enqueue", "--stage", "s", "--job-id", "J1", "--input=-Infinity"], "--input"),
    (["enqueue", "--stage", "s", "--job-id", "J1", "--input", '{"a": 1e999}'], "--input"),
    (["enqueue", "--stage", "s", "--job-id", "J1", "--input", _deep(100_000)], "--input"),
    (["enqueue", "--stage", "s", "--job-id", "J1", "--max-dequeues", "0"], "--max-dequeues"),
    (["enqueue", "--stage", "s", "--job-id", "J1", "--max-dequeues", "-2"], "--max-dequeues"),
    (["requests", "list", "--limit", "0", "--all"], "--limit"),
    (["requests", "list", "--limit", "-1"], "--limit"),
]


@pytest.mark.parametrize(("argv", "named"), BAD_WORKSPACE_ARGS)
async def test_a_bad_number_or_input_is_a_usage_error_and_sends_nothing(
    capsys: pytest.CaptureFixture[str], server: TestServer, argv: list[str], named: str
) -> None:
    """NaN, Infinity and 1e999 are not JSON (Python's parser takes them, the server refused the
    body as malformed: exit 1, blaming the server); an input nested 100,000 deep was a
    RecursionError traceback; `--limit 0 --all` printed no request at all, as if there were
    none; zero or negative counts were sent to be refused."""
    where = ["--workspace", WS] if argv[0] == "enqueue" or argv[1] == "list" else []
    code = await asyncio.to_thread(workspace_main, [*argv, *where, *_auth(server), "--json"])
    out, err = capsys.readouterr()
    assert out == ""
    error = json.loads(err)["error"]
    assert code == EXIT_USAGE
    assert error["code"] == "usage"
    assert named in error["message"]
    async with api.QueueClient(url_of(server), token_for(WS)) as qc:
        assert await qc.list_requests(workspace_id=WS) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["enqueue", "--workspace", WS],  # no --stage
        ["requests", "list", "--limit", "ten"],
        ["requests", "frobnicate"],
        ["enqueue", "--workspace", WS, "--stage", "s", "--no-such-flag"],
    ],
    ids=["missing-stage", "limit-not-a-number", "unknown-verb", "unknown-flag"],
)
def test_argparse_refusals_are_json_on_stderr_too(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """The module promises JSON errors on stderr; argparse's own refusals were its plain-text
    usage lines, which a caller parsing stderr as JSON (an agent) could not read."""
    with pytest.raises(SystemExit) as exited:
        workspace_main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert exited.value.code == EXIT_USAGE
    assert out == ""
    error = json.loads(err)["error"]
    assert error["code"] == "usage"
    assert error["message"].startswith("cv-workspace")


def test_cv_worker_argparse_refusals_are_json_too(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        worker_main(["--concurrency", "many", "--json"])
    assert exited.value.code == EXIT_USAGE
    error = json.loads(capsys.readouterr().err)["error"]
    assert error["code"] == "usage"
    assert "--concurrency" in error["message"]


SECRET_TOKEN = "cvt1.s3cr3t-b64"

BAD_CONNECTION_ARGS: list[tuple[Callable[[str], list[str]], str]] = [
    (lambda url: ["--url", url], "--token"),  # no token at all (and no $CV_TOKEN)
    (lambda url: ["--url", url, "--token", SECRET_TOKEN + "\nX-Injected: 1"], "--token"),
    (lambda url: ["--url", url, "--token", SECRET_TOKEN + " extra"], "--token"),
    (lambda url: ["--url", url, "--token", SECRET_TOKEN + "é"], "--token"),
    (lambda url: ["--url", url.replace("://", "://user:pw@"), "--token", SECRET_TOKEN], "--url"),
    (lambda url: ["--url", url + "?x=1", "--token", SECRET_TOKEN], "--url"),
    (lambda url: ["--url", url + "#top", "--token", SECRET_TOKEN], "--url"),
    (lambda url: ["--url", "http://127.0.0.1:99999", "--token", SECRET_TOKEN], "--url"),
    (lambda url: ["--url", "http://127.0.0.1:port", "--token", SECRET_TOKEN], "--url"),
]


@pytest.mark.parametrize(("connection", "named"), BAD_CONNECTION_ARGS)
async def test_a_missing_or_malformed_token_or_url_is_a_usage_error_that_never_echoes_the_token(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    server: TestServer,
    connection: Callable[[str], list[str]],
    named: str,
) -> None:
    """A token with a newline, or a URL carrying credentials, was a ValueError traceback from
    aiohttp; a port past 65535 or a query put in the URL sent the call elsewhere (a connection
    error, or a 404 from `/`); no token at all was the server's 401 (exit 1) for an argument
    the command could see was missing."""
    monkeypatch.delenv("CV_TOKEN", raising=False)
    argv = [
        "enqueue",
        "--workspace",
        WS,
        "--stage",
        "s",
        "--job-id",
        "J1",
        *connection(url_of(server)),
        "--json",
    ]
    code = await asyncio.to_thread(workspace_main, argv)
    out, err = capsys.readouterr()
    assert out == ""
    error = json.loads(err)["error"]
    assert code == EXIT_USAGE
    assert error["code"] == "usage"
    assert named in error["message"]
    assert "s3cr3t" not in err
    assert "pw@" not in err
    async with api.QueueClient(url_of(server), token_for(WS)) as qc:
        assert await qc.list_requests(workspace_id=WS) == []


@pytest.mark.parametrize(("connection", "named"), BAD_CONNECTION_ARGS)
async def test_the_worker_refuses_the_same_token_and_url_before_starting(
    monkeypatch: pytest.MonkeyPatch,
    server: TestServer,
    connection: Callable[[str], list[str]],
    named: str,
) -> None:
    """The worker printed `ready` and then exited 1 on the server's 401, died of aiohttp's
    ValueError, or (port 99999) retried its claims forever."""
    monkeypatch.delenv("CV_TOKEN", raising=False)  # the process must not inherit one
    code, err = await _worker_process(
        *connection(url_of(server)), "--stages", "tests.worker.cli_stages:STAGES"
    )
    assert "Traceback" not in err, err
    assert code == EXIT_USAGE, err
    error = json.loads(err.strip().splitlines()[-1])["error"]
    assert error["code"] == "usage"
    assert named in error["message"]
    assert "s3cr3t" not in err


async def test_a_url_with_a_path_is_kept_as_a_prefix_for_a_reverse_proxy(
    capsys: pytest.CaptureFixture[str], server: TestServer
) -> None:
    """Not a usage error: the SDK joins every route to the URL (websockets included), so a
    server behind `https://gateway/cv/` is reached as `--url https://gateway/cv`. A server that
    has no such prefix says so in its answer."""
    argv = ["requests", "show", "--workspace", WS, "d_x", "--url", url_of(server) + "/cv",
            "--token", token_for(WS), "--json"]  # fmt: skip
    code = await asyncio.to_thread(workspace_main, argv)
    error = json.loads(capsys.readouterr().err)["error"]
    assert code == 1
    assert error["code"] == "not_found"
    assert "/cv/v1/workspaces/" in error["message"]


# -- signals ---------------------------------------------------------------------------------------


async def _waiters_parked(server: TestServer, count: int, within: float = 30.0) -> None:
    """Wait until `count` request waiters are parked on the server (a state, not a duration)."""
    assert server.app is not None
    async with asyncio.timeout(within):
        while server.app[WAITERS].count < count:  # noqa: ASYNC110  (a state)
            await asyncio.sleep(0.005)


@pytest.mark.parametrize(
    ("sig", "expected"),
    [(signal.SIGINT, 128 + signal.SIGINT), (signal.SIGTERM, 128 + signal.SIGTERM)],
    ids=["SIGINT", "SIGTERM"],
)
async def test_a_signal_mid_wait_exits_at_once_without_a_traceback(
    server: TestServer, sig: int, expected: int
) -> None:
    """Ctrl-C on `requests wait` printed a KeyboardInterrupt traceback; SIGTERM killed it
    outright. Both now end the wait at once (the request goes on) with 128 + the signal."""
    async with api.QueueClient(url_of(server), token_for(WS)) as qc:
        answer = await qc.enqueue(WS, stage="nobody-serves-this", job_id="J1")
        proc = await asyncio.create_subprocess_exec(
            *_command("workspace", "requests", "wait", "--workspace", WS, answer.request_id,
                      "--timeout", "120", *_auth(server)),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            await _waiters_parked(server, 1)
            proc.send_signal(sig)
        finally:
            code, out, err = await _finish(proc, within=10)  # not the 120 s of the wait
        row = await qc.get_request(WS, answer.request_id)
    assert "Traceback" not in err, err
    assert err == ""
    assert out == ""
    assert code == expected
    assert row.status == "pending"


async def test_ctrl_c_on_enqueue_wait_still_prints_the_request_id(server: TestServer) -> None:
    """The wait is the operator's, the request is the queue's: as with a timeout (exit 3), the
    answer names the request so it can be waited for again."""
    proc = await asyncio.create_subprocess_exec(
        *_command("workspace", "enqueue", "--workspace", WS, "--stage", "nobody-serves-this",
                  "--job-id", "J1", "--wait", "--timeout", "120", *_auth(server)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await _waiters_parked(server, 1)
        proc.send_signal(signal.SIGINT)
    finally:
        code, out, err = await _finish(proc, within=10)
    assert err == ""
    assert code == 128 + signal.SIGINT
    answer = json.loads(out)
    assert answer["status"] == "interrupted"
    assert answer["request_id"] == answer["enqueued"]["request_id"]
    async with api.QueueClient(url_of(server), token_for(WS)) as qc:
        row = await qc.get_request(WS, answer["request_id"])
    assert row.status == "pending"


def __getattr__(name: str) -> Any:
    """`--stages tests.cli.test_operator:SLOW_STAGES`: stages whose module takes its time to
    load (a model read from disk, say) — here until stdin closes — so that a signal can arrive
    before the worker is ready."""
    if name == "SLOW_STAGES":
        print("loading stages", file=sys.stderr, flush=True)
        sys.stdin.readline()
        return DOUBLE_STAGES
    raise AttributeError(name)


async def test_ctrl_c_while_the_worker_loads_its_stages_exits_without_a_traceback(
    server: TestServer,
) -> None:
    proc = await asyncio.create_subprocess_exec(
        *_command(
            "worker", *_auth(server), "--stages", "tests.cli.test_operator:SLOW_STAGES"
        ),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        line = await asyncio.wait_for(proc.stderr.readline(), 60)
        assert line == b"loading stages\n"
        proc.send_signal(signal.SIGINT)
    finally:
        code, out, err = await _finish(proc, within=10)
    assert "Traceback" not in err, err
    assert out == ""
    assert code == 128 + signal.SIGINT


# -- --help ----------------------------------------------------------------------------------------

HELP = [
    ["--help"],
    ["enqueue", "--help"],
    ["requests", "--help"],
    *(
        ["requests", verb, "--help"]
        for verb in ("list", "show", "wait", "replay", "discard", "rerun")
    ),
]


@pytest.mark.parametrize("argv", HELP, ids=" ".join)
def test_every_cv_workspace_command_has_working_help(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        workspace_main(argv)
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: cv-workspace")


def test_cv_worker_help_and_the_module_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        worker_main(["--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: cv-worker")
    assert main([]) == EXIT_USAGE
    assert "usage:" in capsys.readouterr().err


# -- the stages demo's summary ---------------------------------------------------------------------


@pytest.mark.parametrize(("agents", "cuts"), [(1, 1), (2, 2), (2, 0)])
async def test_the_demo_counts_as_coalesced_only_enqueues_absorbed_by_another(
    server: TestServer, agents: int, cuts: int
) -> None:
    """The demo printed "8 enqueues, 4 requests (5 coalesced)": an enqueue whose answer the
    flaky network cut was retried by the SDK, and the retry, finding the request its own first
    attempt had made, was answered `coalesced: true`. Coalesced must be what README and
    docs/queue.md say: an enqueue absorbed into a request another enqueue made — here exactly the
    enqueues minus the requests."""
    async with FaultProxy(url_of(server)) as proxy:
        clients = [
            WorkspaceClient(proxy.url, token=token_for(WS), config=fast_client_config())
            for _ in range(agents)
        ]
        try:
            for client in clients:
                await client.start()
            proxy.cut_next(cuts)  # the first answers never arrive: the server made the request
            enqueued = await demo.enqueue_evaluations(clients, WS, ["J1"], {"columns": []})
        finally:
            for client in clients:
                await client.close()
        assert proxy.stats.cuts == cuts
    assert len({e.request_id for e in enqueued}) == 1
    assert sum(e.coalesced for e in enqueued) == agents - 1
    assert (
        demo.enqueue_summary(enqueued) == f"{agents} enqueues, 1 requests ({agents - 1} coalesced)"
    )
