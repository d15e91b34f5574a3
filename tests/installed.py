"""The package as users install it: a wheel built from the checkout, installed into a fresh
virtualenv, offline. The wheel's dependencies are not downloaded: the distributions this
interpreter already has are linked into a site directory of their own, which the virtualenv
reads through a `.pth` file, as an offline index would serve them. Only what the requirements
name (with the extras asked for) is linked, so a module the wheel forgot to require is missing
there (tests/test_packaging.py, tests/client/testing/test_docs_example.py)."""

from __future__ import annotations

import importlib.metadata as metadata
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement

__all__ = ["BOUND", "ROOT", "build_wheel", "install_wheel", "run_in"]

ROOT = Path(__file__).resolve().parents[1]
#: Seconds any one build, install or command may take.
BOUND = 180.0


def build_wheel(into: Path) -> Path:
    """`pip wheel` of the checkout's files, offline and without build isolation: the wheel's
    path. Built from a copy of what git tracks or would track (ignored files left out), never in
    the checkout itself, whose `build/` would otherwise ship a module deleted since the last
    build (tests/test_packaging.py pins it)."""
    source = into / "source"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=BOUND,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, listed):
        path = ROOT / name
        if path.is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(into), str(source)],
        check=True, capture_output=True, timeout=BOUND,
    )  # fmt: skip
    (wheel,) = into.glob("cv_workspace-*.whl")
    return wheel


def install_wheel(
    wheel: Path, work: Path, *, extras: Iterable[str] = (), also: Iterable[str] = ()
) -> Path:
    """A fresh virtualenv in `work/venv` with `wheel` installed and the distributions it requires
    with `extras` (`"server"`: as `pip install 'wheel[server]'`), plus those named in `also`
    (an app's own test tools: `pytest`, `pytest-asyncio`), linked in. Returns the venv."""
    venv = work / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        check=True,
        capture_output=True,
        timeout=BOUND,
    )
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
         "--no-deps", "-q", str(wheel)],
        check=True, capture_output=True, timeout=BOUND,
    )  # fmt: skip
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
        timeout=BOUND,
    ).stdout.strip()
    deps = work / "dependencies"
    _link_distributions(_closure([*_requirements(extras), *also]), deps)
    (Path(site) / "dependencies.pth").write_text(f"{deps}\n")
    return venv


def run_in(
    venv: Path, *argv: str, cwd: Path | None = None, timeout: float = BOUND
) -> subprocess.CompletedProcess[str]:
    """`argv[0]` from the venv's `bin/`, in `cwd` (default: the venv), with a PATH of the venv
    and the system only: the installed wheel runs, never the checkout."""
    return subprocess.run(
        [str(venv / "bin" / argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or venv,
        env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin"},
    )


def _requirements(extras: Iterable[str]) -> list[str]:
    """What `cv-workspace` itself requires, and with each of `extras`."""
    requires = metadata.distribution("cv-workspace").requires or []
    names = []
    for extra in ("", *extras):
        for raw in requires:
            requirement = Requirement(raw)
            if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                names.append(requirement.name)
    return names


def _closure(names: list[str]) -> set[str]:
    """The installed distributions `names` need to run, themselves included (markers for this
    interpreter honoured, extras not followed)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        dist = metadata.distribution(todo.pop())
        name = dist.metadata["Name"].lower()
        if name in seen:
            continue
        seen.add(name)
        for raw in dist.requires or []:
            requirement = Requirement(raw)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def _link_distributions(names: set[str], into: Path) -> None:
    """Symlink each distribution's top-level files (packages, modules, its dist-info) into
    `into`: a site directory holding these and nothing else, as an offline index would."""
    into.mkdir()
    for name in names:
        dist = metadata.distribution(name)
        for file in dist.files or []:
            top = Path(file.parts[0])
            if top.name in ("..", "__pycache__") or top.suffix == ".pth":
                continue
            source = Path(str(dist.locate_file(top)))
            target = into / top.name
            if source.exists() and not target.exists():
                target.symlink_to(source)
