"""The documentation in `docs/` holds what the code says: one anchor per problem code (which the
problem `type` resolves to), every setting, every op's rejection codes, examples that parse,
links that resolve, and `--help` texts that name only documents that exist."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from cv_mutations import REJECTION_CODES, parse_op
from cv_server import ServerConfig, create_app
from cv_server.http.openapi import build_document
from cv_server.http.problems import CODES, Problem
from cv_server.oplog.pipeline import (
    ATOMIC_ABORTED,
    OP_EXPIRED,
    OP_ID_REUSE,
    SEQ_GAP,
    VERSION_CONFLICT,
)
from cv_workspace_client import ClientConfig, WorkerConfig

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

#: Pages linked from the index whose authors work on other branches: a link to one of them is
#: checked once the page is in the tree, and tolerated while it is not. Anchors into them are
#: never tolerated.
PAGES_FROM_OTHER_BRANCHES = frozenset(
    {
        "docs/observability.md",
        "docs/dashboard.md",
        "docs/architecture.md",
        "schemas/openapi.json",
    }
)

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
_EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", REPO / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped (but `-` and
    `_`), spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    found: set[str] = set(_EXPLICIT_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(text):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def _links(page: Path) -> Iterator[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    yield from _LINK.findall(text)


def test_every_problem_code_has_its_anchor_and_a_published_base_resolves_to_it() -> None:
    page = DOCS / "problems.md"
    documented = anchors(page)
    missing = sorted(code for code in CODES if code not in documented)
    assert missing == [], f"problem codes without a section in docs/problems.md: {missing}"
    published = "https://docs.example.com/cv-workspace/docs/problems.md#"
    for code in CODES:
        target = urlsplit(Problem(400, code).to_json(published)["type"])
        assert (REPO / target.path.removeprefix("/cv-workspace/")).resolve() == page.resolve()
        assert target.fragment == code


def test_the_routes_the_protocol_says_need_no_token_are_those_served_without_one() -> None:
    """docs/protocol.md's list of the routes that need no token, against the routes the server
    documents without a security requirement (what `/openapi.json` tells outside clients)."""
    document = build_document(create_app(ServerConfig()))
    public = {
        path
        for path, operations in document["paths"].items()
        for operation in operations.values()
        if not operation["security"]
    }
    text = (DOCS / "protocol.md").read_text(encoding="utf-8")
    section = text.split("## Authentication", 1)[1].split("\n## ", 1)[0]
    sentences = re.split(r"\.\s", " ".join(section.split()))
    (listing,) = [sentence for sentence in sentences if sentence.startswith("Every route")]
    assert set(re.findall(r"`(/[^`]*)`", listing)) == public


def test_every_op_rejection_code_is_in_the_ops_reference() -> None:
    table = (DOCS / "ops.md").read_text(encoding="utf-8").split("## Rejection codes", 1)[1]
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", table, re.MULTILINE))
    assert listed == {
        *REJECTION_CODES,
        OP_ID_REUSE,
        ATOMIC_ABORTED,
        SEQ_GAP,
        OP_EXPIRED,
        VERSION_CONFLICT,
    }


def test_the_json_examples_of_the_ops_reference_parse() -> None:
    blocks = re.findall(r"```json\n(.*?)```", (DOCS / "ops.md").read_text(encoding="utf-8"), re.S)
    ops = [json.loads(block) for block in blocks]
    assert {op["type"] for op in ops} == {
        "node.insert",
        "node.move",
        "node.delete",
        "node.update",
        "node.increment",
    }
    for op in ops:
        assert parse_op(op).type == op["type"]


@pytest.mark.parametrize(
    ("config", "heading"),
    [
        (ServerConfig, "## ServerConfig"),
        (ClientConfig, "## ClientConfig"),
        (WorkerConfig, "## WorkerConfig"),
    ],
)
def test_every_setting_is_documented_in_configuration(config: type, heading: str) -> None:
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| (?:<a id=\"[a-z_]+\"></a>)?`([a-z_]+)` \|", section, re.MULTILINE))
    missing = sorted(f.name for f in dataclasses.fields(config) if f.name not in rows)
    assert missing == [], f"{config.__name__} fields missing from docs/configuration.md: {missing}"


def _broken_links() -> Iterator[str]:
    for page in _markdown_files():
        for link in _links(page):
            parts = urlsplit(link)
            if parts.scheme or link.startswith("//"):
                continue  # another site: not checked offline
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            shown = f"{page.relative_to(REPO)}: {link}"
            if not target.is_relative_to(REPO):
                yield f"{shown} (outside the repository)"
                continue
            relative = target.relative_to(REPO).as_posix()
            if not target.exists():
                if relative not in PAGES_FROM_OTHER_BRANCHES or parts.fragment:
                    yield f"{shown} (no such file)"
                continue
            if parts.fragment and parts.fragment not in anchors(target):
                yield f"{shown} (no such anchor)"


def test_every_link_in_the_readme_the_changelog_and_docs_resolves() -> None:
    assert list(_broken_links()) == []


def test_the_link_check_catches_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    assert "bad-anchor" not in anchors(DOCS / "problems.md")
    assert "not_found" in anchors(DOCS / "problems.md")
    assert _slug("`node.insert` — `NodeInsert`") == "nodeinsert--nodeinsert"
    assert _slug("The three layers") == "the-three-layers"


def test_every_python_example_in_the_readme_and_docs_compiles() -> None:
    for page in _markdown_files():
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"```python\n(.*?)```", text, re.DOTALL):
            # Examples run inside an app's coroutine: top-level `async with` / `await` are fine.
            compile(block, str(page), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def test_the_readme_fits_its_brief() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    first_screen = text.splitlines()[:40]
    assert len(text.splitlines()) < 120
    assert any(line.startswith("from cv_workspace_client import") for line in first_screen)
    assert "./scripts/serve" in text
    assert "./scripts/test" in text


# -- --help texts -------------------------------------------------------------------------------

_SUBCOMMANDS = re.compile(r"^\s*\{([a-z][a-z,-]*)\}", re.MULTILINE)
_DOC_REFERENCE = re.compile(r"(?:[\w.-]+/)*[\w.-]+\.md(?:#[\w-]+)?")


def _help_texts(
    run: Callable[[list[str]], object], capsys: pytest.CaptureFixture[str], path: list[str]
) -> Iterator[tuple[str, str]]:
    with pytest.raises(SystemExit) as exited:
        run([*path, "--help"])
    assert exited.value.code in (0, None)
    text = capsys.readouterr().out
    yield " ".join(path), text
    match = _SUBCOMMANDS.search(text)
    if match:
        for name in match.group(1).split(","):
            yield from _help_texts(run, capsys, [*path, name])


def _commands() -> dict[str, Callable[[list[str]], object]]:
    names = ("cv-server", "cv-worker", "cv-workspace")
    found = {ep.name: ep for ep in entry_points(group="console_scripts") if ep.name in names}
    return {name: found[name].load() for name in names}


def test_every_help_text_names_only_documents_that_exist(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen = 0
    for name, run in _commands().items():
        for command, text in _help_texts(run, capsys, []):
            seen += 1
            assert _BLUEPRINT_REFERENCE.search(text) is None, (name, command)
            for reference in _DOC_REFERENCE.findall(text):
                path, _, fragment = reference.partition("#")
                target = REPO / path if "/" in path else DOCS / path
                pending = target.relative_to(REPO).as_posix() in PAGES_FROM_OTHER_BRANCHES
                if not target.exists() and pending and not fragment:
                    continue
                assert target.exists(), f"{name} {command} --help names {reference}"
                if fragment:
                    assert fragment in anchors(target), f"{name} {command} --help: {reference}"
    assert seen >= 10, "the subcommands' help texts were not all read"


# -- no references to documents users do not have -------------------------------------------

#: The design notes and source documents the project was built from are not shipped: code, help
#: texts and messages cite the docs/ page that holds the rule instead, or state it. (Spelled in
#: pieces so that this file does not match itself.)
_BLUEPRINT_REFERENCE = re.compile("|".join([r"\bDES" + r"IGN\b", r"\bseeds? 0" + r"0\d"]))
_CHECKED_TREES = ("cv_mutations", "cv_workspace_client", "cv_server", "scripts", "bench")


def _references() -> Iterator[str]:
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--", *_CHECKED_TREES, "examples", "tests"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        path = REPO / name
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not text
        # A reference may be cut by a line break inside a comment: "DES" "IGN\n# §6".
        joined = re.sub(r"\s*\n\s*(?:#:?|--)?\s*", " ", text)
        for match in _BLUEPRINT_REFERENCE.finditer(joined):
            yield f"{name}: ...{joined[max(0, match.start() - 30) : match.end() + 10]}..."


def test_no_code_help_text_or_message_cites_the_unshipped_design_notes() -> None:
    assert list(_references()) == []


# -- what a newcomer runs: installs, the files it writes, the ports ------------------------------

_INSTALL = re.compile(r"\bpip install\s+([^`\n]*)")
_PROJECT = "cv-workspace"


def _install_specs(text: str) -> Iterator[str]:
    """The requirement specs of every `pip install` line (options and their values dropped)."""
    for line in _INSTALL.findall(text):
        line = line.split("#", 1)[0]  # a shell comment
        for word in line.split():
            word = word.strip("'\"")
            if word and not word.startswith("-"):
                yield word


def _names_the_index(spec: str) -> bool:
    """True for a spec only a package index can satisfy: this project by name (`cv-workspace`,
    `cv_workspace[mcp]`), not a path to a checkout or a wheel (`.[mcp]`, `dist/x.whl`)."""
    name = re.split(r"[\[<>=!~;@ ]", spec, maxsplit=1)[0]
    is_path = "/" in name or name.startswith(".") or name.endswith(".whl")
    return not is_path and re.sub(r"[-_.]+", "-", name).lower() == _PROJECT


def test_no_install_line_in_the_readme_or_docs_needs_a_package_index() -> None:
    # cv-workspace is not published on an index: `pip install 'cv-workspace[mcp]'` fails on a
    # fresh machine. Docs install a checkout or a wheel built from one (docs/install.md).
    assert _names_the_index("cv-workspace[mcp]")
    assert not _names_the_index(".[server,mcp]")
    assert not _names_the_index("/path/to/checkout[mcp]")
    assert not _names_the_index("dist/cv_workspace-*.whl")
    found = {
        f"{page.relative_to(REPO)}: {spec}"
        for page in _markdown_files()
        if page.name != "CHANGELOG.md"  # history, not instructions
        for spec in _install_specs(page.read_text(encoding="utf-8"))
    }
    assert found, "no install line found: the check reads nothing"
    assert sorted(line for line in found if _names_the_index(line.split(": ", 1)[1])) == []


def test_the_extras_table_lists_every_extra_and_its_packages() -> None:
    import tomllib

    with (REPO / "pyproject.toml").open("rb") as file:
        extras: dict[str, list[str]] = tomllib.load(file)["project"]["optional-dependencies"]
    text = (DOCS / "install.md").read_text(encoding="utf-8")
    table = text.split("## Extras", 1)[1].split("\n## ", 1)[0]
    rows = {
        match.group(1): match.group(2)
        for match in re.finditer(r"^\| `([a-z]+)` \|([^\n]*)$", table, re.MULTILINE)
    }
    assert set(rows) == set(extras)
    for extra, requirements in extras.items():
        for requirement in requirements:
            name = re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0]
            if name != _PROJECT:
                assert f"`{name}`" in rows[extra], f"docs/install.md: {extra} lacks {name}"


def _files_the_readme_writes() -> set[str]:
    """Paths, relative to the checkout, that the README's commands and example create there."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    example = (REPO / "examples" / "quickstart.py").read_text(encoding="utf-8")
    written = set(re.findall(r"\./(data/[\w.]+)", readme))  # the server's database
    for block in re.findall(r"```(?:bash|json|python)\n(.*?)```", readme, re.DOTALL):
        written.update(re.findall(r"(?<![>2&])>\s*([\w./-]+)", block))  # `echo ... > token`
        written.update(re.findall(r"outbox[=\"', ]+([\w./-]+\.db)", block))
    written.update(re.findall(r"outbox=\"([\w./-]+)\"", example))
    return written


def test_git_ignores_every_file_the_readme_writes_into_the_checkout() -> None:
    # `git add -A` after the quick start must not pick up the bearer token or a database.
    written = _files_the_readme_writes()
    assert {"token", "data/cv.db", "quickstart.outbox.db", "agent-outbox.db"} <= written
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=REPO,
        input="\n".join(sorted(written)),
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    assert sorted(written - set(ignored)) == []


#: The port plan of docs/configuration.md#ports: who listens where in the README's walk-through.
_PLAN_ROW = re.compile(r"^\| (\d+) \| ([^|]+) \|", re.MULTILINE)
_LOOPBACK_URL = re.compile(r"http://(?:127\.0\.0\.1|localhost):(\d+)([^\s`\"')]*)")


def _port_plan() -> dict[str, int]:
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    section = text.split("\n## Ports", 1)[1].split("\n## ", 1)[0]
    plan: dict[str, int] = {}
    for port, who in _PLAN_ROW.findall(section):
        for role in ("cv-server", "cv-workspace mcp", "fake_provider", "PostgreSQL"):
            if role in who:
                plan[role] = int(port)
    return plan


def test_the_commands_the_readme_runs_listen_on_distinct_ports_the_plan_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cv_server.cli import _parser as server_parser
    from cv_workspace_client.cli.workspace import _workspace_parser

    monkeypatch.delenv("CV_PORT", raising=False)  # the defaults, not this shell's choice
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    provider = re.search(r"fake_provider --port (\d+)", readme)
    assert provider is not None
    ports = {
        "cv-server": server_parser().parse_args(["serve"]).port,
        "cv-workspace mcp": _workspace_parser().parse_args(["mcp"]).port,
        "fake_provider": int(provider.group(1)),
    }
    assert len(set(ports.values())) == len(ports), ports
    plan = _port_plan()
    assert {role: plan.get(role) for role in ports} == ports
    assert len(set(plan.values())) == len(plan), plan


def test_every_loopback_url_in_the_readme_and_docs_follows_the_port_plan() -> None:
    plan = _port_plan()
    wrong = []
    for page in _markdown_files():
        if page.name == "CHANGELOG.md":
            continue
        for port, path in _LOOPBACK_URL.findall(page.read_text(encoding="utf-8")):
            if path.startswith("/mcp"):
                role = "cv-workspace mcp"
            elif path == "/v1":  # an OpenAI-compatible base URL: the provider
                role = "fake_provider"
            else:
                role = "cv-server"
            if int(port) != plan[role]:
                wrong.append(f"{page.relative_to(REPO)}: :{port}{path} is {role}'s, not it")
    assert wrong == []


if __name__ == "__main__":  # `python -m tests.test_docs`: list broken links
    broken = list(_broken_links())
    print("\n".join(broken) or "every link resolves")
    sys.exit(1 if broken else 0)
