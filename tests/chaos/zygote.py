"""Start chaos writers and workers by fork from one process that imported them already.

A chaos run kills and restarts its writers and `cv-worker`s dozens of times. Each new Python
process spent most of its start importing aiohttp, pydantic and the SDK: on a loaded 2-core
machine seconds of wall time per restart, so a run spent its time starting processes instead of
testing them. This process (`python -m tests.chaos.zygote`) imports them once and forks a child
per start: each child is a real, separate OS process (its own pid, sockets, outbox connection,
event loop), SIGKILLed like any other, that runs the same entry point as
`python -m tests.chaos.writer` or `cv-worker`.

Protocol, one JSON object per line: on stdin `{"spawn": ID, "kind": "writer"|"worker",
"argv": [...], "log": PATH}`; on stdout `{"spawned": ID, "pid": PID}` and, when a child ends,
`{"exited": PID, "code": CODE}` (a signal's death is `-SIGNAL`). EOF on stdin: the zygote
kills its children and exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import sys
from typing import Any

import cv_workspace_client.cli as worker_cli
import tests.chaos.writer as writer

__all__ = ["main"]


def _run_child(kind: str, argv: list[str], log: str) -> None:
    """In the child: output to its log, default signal handling, the entry point, exit."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        code = writer.main(argv) if kind == "writer" else worker_cli.worker_main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # the child must never return into the zygote's loop
        print(f"{kind} crashed: {exc!r}", file=sys.stderr, flush=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    children: set[int] = set()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd does the work
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ, "stdin")
    pending = b""
    selector.register(wake_r, selectors.EVENT_READ, "child")
    _emit({"ready": os.getpid()})
    try:
        while True:
            for key, _ in selector.select():
                if key.data == "child":
                    os.read(wake_r, 4096)
                    _reap(children)
                    continue
                data = os.read(0, 65536)
                if not data:
                    return 0
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    command = json.loads(line)
                    pid = os.fork()
                    if pid == 0:
                        _run_child(command["kind"], command["argv"], command["log"])
                    children.add(pid)
                    _emit({"spawned": command["spawn"], "pid": pid})
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _reap(children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        _emit({"exited": pid, "code": code})


if __name__ == "__main__":
    raise SystemExit(main())
