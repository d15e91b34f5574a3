"""`cv-worker --stages mymod:STAGES`, run as the installed console script from the directory that
holds `mymod.py` (the README's way): the module is found there, as `python -m` finds it, and
one that cannot be loaded is the documented one-line JSON usage error (exit 2)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from cv_workspace_client._queue import requester as api
from tests.worker.conftest import WS, token_for, url_of

#: The console script pip installed next to the interpreter (`.venv/bin/cv-worker`): run as a
#: file, it gets its own directory on sys.path, not the current one.
CV_WORKER = Path(sys.executable).with_name("cv-worker")

STAGES_MODULE = """
async def times(ctx):
    import cwd_factor_for_cli_test  # a sibling, imported only when the stage first runs

    return ctx.input * cwd_factor_for_cli_test.FACTOR


STAGES = {"times": times}
"""


def _environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


async def _worker(cwd: Path, url: str, stages: str, **env: str) -> asyncio.subprocess.Process:
    assert CV_WORKER.exists(), f"the console script is not installed: {CV_WORKER}"
    return await asyncio.create_subprocess_exec(
        str(CV_WORKER), "--url", url, "--token", token_for(WS), "--stages", stages,
        "--worker-id", "cwd-worker", "--log-level", "WARNING", "--json",
        cwd=cwd, env=_environment(**env),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def _refused(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    """The exit status and the one error of a worker that must stop before it is ready."""
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:  # had it loaded the stages, it would run until killed
            proc.kill()
            await proc.wait()
    assert out == b""  # never "ready"
    text = err.decode()
    assert "Traceback" not in text, text
    assert text.count("\n") == 1, text
    error = json.loads(text)["error"]
    assert error["code"] == "usage"
    assert proc.returncode is not None
    return proc.returncode, str(error["message"])


async def test_the_console_script_runs_a_stages_module_from_the_current_directory(
    tmp_path: Path, server: TestServer
) -> None:
    (tmp_path / "cwd_stages_for_cli_test.py").write_text(STAGES_MODULE)
    (tmp_path / "cwd_factor_for_cli_test.py").write_text("FACTOR = 7\n")
    proc = await _worker(tmp_path, url_of(server), "cwd_stages_for_cli_test:STAGES")
    try:
        assert proc.stdout is not None
        ready = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not ready:  # it stopped: say why
            _, err = await proc.communicate()
            pytest.fail(f"cv-worker stopped before it was ready: {err.decode()}")
        assert ready.decode().startswith("cv-worker cwd-worker ready")
        async with api.QueueClient(url_of(server), token_for(WS)) as qc:
            answer = await qc.enqueue(WS, stage="times", job_id="J1", input=6)
            done = await qc.wait_request(WS, answer.request_id, timeout=30)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert done.error is None, done.error
    assert done.result == 42
    assert code == 0


async def test_a_stages_module_that_is_nowhere_names_where_it_was_looked_for(
    tmp_path: Path,
) -> None:
    proc = await _worker(tmp_path, "http://127.0.0.1:9", "no_such_stages_module:STAGES")
    code, message = await _refused(proc)
    assert code == 2
    assert "no_such_stages_module" in message
    assert str(tmp_path) in message


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("def broken(:\n", "SyntaxError"),
        ("\n\nraise RuntimeError('no config here')\n", "RuntimeError: no config here"),
        ("import a_dependency_nobody_installed\n", "a_dependency_nobody_installed"),
    ],
    ids=["syntax-error", "raises-on-import", "lacks-a-dependency"],
)
async def test_a_stages_module_that_fails_to_import_is_one_usage_error_naming_the_place(
    tmp_path: Path, source: str, named: str
) -> None:
    """A SyntaxError or an exception raised by the module was a traceback with exit 1."""
    module = tmp_path / "failing_stages_for_cli_test.py"
    module.write_text(source)
    proc = await _worker(tmp_path, "http://127.0.0.1:9", "failing_stages_for_cli_test:STAGES")
    code, message = await _refused(proc)
    assert code == 2
    assert named in message
    assert "failing_stages_for_cli_test.py" in message  # where to look


@pytest.mark.parametrize("spec", [".relative_stages:STAGES", "./stages_file:STAGES"])
async def test_a_stages_spec_that_is_not_a_module_name_is_a_usage_error(
    tmp_path: Path, spec: str
) -> None:
    """A relative name (`.mod`) was a TypeError traceback from importlib."""
    code, message = await _refused(await _worker(tmp_path, "http://127.0.0.1:9", spec))
    assert code == 2
    assert "pkg.module:NAME" in message


async def test_a_file_name_instead_of_a_module_name_gets_a_hint(tmp_path: Path) -> None:
    (tmp_path / "my_stages_file.py").write_text(STAGES_MODULE)
    proc = await _worker(tmp_path, "http://127.0.0.1:9", "my_stages_file.py:STAGES")
    code, message = await _refused(proc)
    assert code == 2
    assert "not a file: my_stages_file" in message


async def test_python_safe_path_keeps_the_current_directory_out(tmp_path: Path) -> None:
    """`PYTHONSAFEPATH` (`python -P`) asks for no current-directory entry on sys.path: honoured,
    as `python -m` honours it."""
    (tmp_path / "cwd_stages_for_cli_test.py").write_text(STAGES_MODULE)
    proc = await _worker(
        tmp_path, "http://127.0.0.1:9", "cwd_stages_for_cli_test:STAGES", PYTHONSAFEPATH="1"
    )
    code, message = await _refused(proc)
    assert code == 2
    assert "current directory" not in message
