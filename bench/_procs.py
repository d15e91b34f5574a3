"""Process plumbing for benchmarks: start the real `cv-server`, sample its RSS and CPU, raise the
fd limit. Nothing here knows about ops; `bench.oplog` drives it.
"""

from __future__ import annotations

import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

import psutil  # type: ignore[import-untyped]  # no types-psutil in the dev extras

__all__ = [
    "MachineLoad",
    "ServerProcess",
    "ServerRefused",
    "fsync_probe_ms",
    "percentiles",
    "raise_nofile",
]

#: How long a server may take to print its listening line before we give up on it.
START_TIMEOUT_S: Final = 30.0
#: How long SIGTERM may take (the server drains in-flight commits) before SIGKILL.
STOP_TIMEOUT_S: Final = 40.0
#: RSS/CPU sampling period: short enough to catch a peak during a few-second phase.
SAMPLE_PERIOD_S: Final = 0.02


class ServerRefused(RuntimeError):
    """The server (or its token command) would not start with the given arguments."""


def raise_nofile() -> int:
    """Raise this process's soft fd limit to the hard limit; return the new soft limit.

    Children inherit it, which is how the server gets room for 10,000 sockets without any change
    to the server itself.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def fsync_probe_ms(directory: Path, rounds: int = 40) -> float:
    """Median milliseconds of one 4 KiB write + fsync in `directory`: the floor under a durable
    commit, so readers can tell a slow disk from a slow server."""
    path = directory / "fsync-probe"
    samples: list[float] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
            samples.append((time.perf_counter() - start) * 1000)
    finally:
        os.close(fd)
        path.unlink()
    samples.sort()
    return samples[len(samples) // 2]


@dataclass(frozen=True, slots=True)
class MachineLoad:
    """Machine-wide CPU counters, to say how busy the box was while a figure was taken (the
    benchmark shares its cores with whatever else runs)."""

    at: float
    busy_s: float
    #: Microseconds during which some runnable task waited for a CPU (Linux PSI), if available.
    cpu_stall_us: int | None

    @classmethod
    def now(cls) -> MachineLoad:
        times = psutil.cpu_times()
        busy = times.user + times.nice + times.system + getattr(times, "irq", 0.0)
        busy += getattr(times, "softirq", 0.0) + getattr(times, "steal", 0.0)
        return cls(time.perf_counter(), busy, _cpu_stall_us())

    def since(self, earlier: MachineLoad) -> tuple[float, float | None]:
        """(busy cores, share of the wall time some task waited for a CPU) between the two."""
        wall = self.at - earlier.at
        if wall <= 0:
            return 0.0, None
        stall = None
        if self.cpu_stall_us is not None and earlier.cpu_stall_us is not None:
            stall = (self.cpu_stall_us - earlier.cpu_stall_us) / 1e6 / wall
        return (self.busy_s - earlier.busy_s) / wall, stall


def _cpu_stall_us() -> int | None:
    try:
        text = Path("/proc/pressure/cpu").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("some "):
            for part in line.split():
                if part.startswith("total="):
                    return int(part.removeprefix("total="))
    return None


def _cli_base(profile_dir: Path | None) -> list[str]:
    if profile_dir is None:
        return [sys.executable, "-m", "cv_server.cli"]
    return [sys.executable, "-m", "bench._profiled_server", str(profile_dir)]


def _backend_args(db: Path, database_url: str | None) -> list[str]:
    args = ["--db", str(db)]
    if database_url:
        args += ["--database-url", database_url]
    return args


@dataclass
class _Samples:
    peak_rss: int = 0
    last_rss: int = 0


@dataclass
class ServerProcess:
    """A running `cv-server serve`, started by `ServerProcess.start`; stop it with `stop()`."""

    proc: subprocess.Popen[str]
    url: str
    token: str
    _ps: psutil.Process
    _samples: _Samples = field(default_factory=_Samples)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop_sampling: threading.Event = field(default_factory=threading.Event)
    _sampler: threading.Thread | None = None
    _stderr_tail: list[str] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        db: Path,
        *,
        database_url: str | None = None,
        profile_dir: Path | None = None,
    ) -> ServerProcess:
        """Set up `db` and mint a token on it, then start the server on it and wait for its
        listening line.

        `profile_dir`: run it under `bench._profiled_server` (CPU profile of every thread).
        Raises `ServerRefused` (with the server's own words) if either step fails.
        """
        # `token` reads an existing deployment only: set it up first (idempotent).
        init_cmd = [*_cli_base(None), "init", *_backend_args(db, database_url)]
        done = subprocess.run(init_cmd, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise ServerRefused(done.stderr.strip() or f"cv-server init exited {done.returncode}")
        token_cmd = [
            *_cli_base(None),
            "token",
            *_backend_args(db, database_url),
            "--workspace",
            "*",
        ]
        done = subprocess.run(token_cmd, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise ServerRefused(done.stderr.strip() or f"cv-server token exited {done.returncode}")
        token = done.stdout.strip().splitlines()[-1]
        serve_cmd = [
            *_cli_base(profile_dir),
            "serve",
            *_backend_args(db, database_url),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--log-level",
            "WARNING",
        ]
        proc = subprocess.Popen(
            serve_cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a Ctrl-C on the bench must not hit the server mid-drain
        )
        assert proc.stdout is not None
        assert proc.stderr is not None
        tail: list[str] = []
        stderr_pump = _pump(proc.stderr, tail)
        lines: queue.Queue[str | None] = queue.Queue()
        _lines(proc.stdout, lines)
        deadline = time.monotonic() + START_TIMEOUT_S
        url = ""
        while not url:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                proc.kill()
                raise ServerRefused("cv-server did not report a listening address in time")
            try:
                line = lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:  # stdout closed: the server exited
                proc.wait(timeout=10)
                stderr_pump.join(timeout=5)  # the server's last words say why
                reason = "".join(tail[-5:]).strip() or f"exit code {proc.returncode}"
                raise ServerRefused(f"cv-server serve exited: {reason}")
            if line.startswith("cv-server listening on "):
                url = line.split(" on ", 1)[1].strip()
        server = cls(proc=proc, url=url, token=token, _ps=psutil.Process(proc.pid))
        server._stderr_tail = tail
        server._sampler = threading.Thread(target=server._sample, name="rss-sampler", daemon=True)
        server._sampler.start()
        return server

    # -- measurements ----------------------------------------------------------------------------

    def _sample(self) -> None:
        while not self._stop_sampling.wait(SAMPLE_PERIOD_S):
            try:
                rss = self._ps.memory_info().rss
            except psutil.Error:
                return
            with self._lock:
                self._samples.last_rss = rss
                self._samples.peak_rss = max(self._samples.peak_rss, rss)

    def rss(self) -> int:
        """The server's resident set size right now, in bytes."""
        return int(self._ps.memory_info().rss)

    def reset_peak(self) -> None:
        """Start a new peak window (the peak of a phase, not of start-up)."""
        with self._lock:
            self._samples.peak_rss = self.rss()

    def peak_rss(self) -> int:
        with self._lock:
            return max(self._samples.peak_rss, self.rss())

    def cpu_seconds(self) -> tuple[float, float]:
        """(main thread, all other threads) CPU seconds so far, user + system.

        The main thread is the event loop (HTTP, websockets, JSON, pydantic); the others are the
        SQLite writer and readers. Which one is saturated says where a missed target comes from.
        """
        main = other = 0.0
        for thread in self._ps.threads():
            spent = thread.user_time + thread.system_time
            if thread.id == self._ps.pid:
                main += spent
            else:
                other += spent
        return main, other

    def stderr_tail(self, lines: int = 20) -> str:
        return "".join(self._stderr_tail[-lines:])

    # -- lifetime --------------------------------------------------------------------------------

    def stop(self) -> int:
        """SIGTERM (the server drains and closes sockets with 1001), SIGKILL if it hangs."""
        self._stop_sampling.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def _pump(stream: IO[str], sink: list[str]) -> threading.Thread:
    """Drain `stream` into `sink` (bounded) on a daemon thread, so a chatty server never blocks
    on a full pipe."""

    def run() -> None:
        for line in stream:
            sink.append(line)
            if len(sink) > 200:
                del sink[:100]

    thread = threading.Thread(target=run, name="stderr-pump", daemon=True)
    thread.start()
    return thread


def _lines(stream: IO[str], out: queue.Queue[str | None]) -> None:
    def run() -> None:
        for line in stream:
            out.put(line)
        out.put(None)

    threading.Thread(target=run, name="stdout-pump", daemon=True).start()


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """p50/p99/max by nearest rank (and the count); empty without samples."""
    if not samples:
        return {}
    ordered = sorted(samples)
    last = len(ordered) - 1
    return {
        "p50": ordered[round(0.50 * last)],
        "p99": ordered[round(0.99 * last)],
        "max": ordered[last],
        "n": float(len(ordered)),
    }
