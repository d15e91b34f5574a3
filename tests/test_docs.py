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
from cv_server import ServerConfig
from cv_server.http.problems import CODES, Problem
from cv_server.oplog.pipeline import ATOMIC_ABORTED, OP_ID_REUSE
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


def test_every_op_rejection_code_is_in_the_ops_reference() -> None:
    table = (DOCS / "ops.md").read_text(encoding="utf-8").split("## Rejection codes", 1)[1]
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", table, re.MULTILINE))
    assert listed == {*REJECTION_CODES, OP_ID_REUSE, ATOMIC_ABORTED}


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


if __name__ == "__main__":  # `python -m tests.test_docs`: list broken links
    broken = list(_broken_links())
    print("\n".join(broken) or "every link resolves")
    sys.exit(1 if broken else 0)
