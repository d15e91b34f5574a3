"""Every test has one cost mark (tests/conftest.py), so `./scripts/test -m unit` runs the fast pure
tests alone and the Hypothesis-driven pure tests run under `-m property`, wherever their module's
own mark says `unit`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = [
    "tests/client/core/test_optimistic.py",  # pytestmark = unit; one test runs a state machine
    "tests/queue/test_lifecycle_properties.py",  # a state machine's TestCase, by directory unit
    "tests/mutations/test_ops.py",  # @given tests beside example tests
]
STATE_MACHINE = "test_optimistic.py::test_the_view_follows_the_server_whatever_commits_interleave"
LIFECYCLE = "test_lifecycle_properties.py::TestRequestLifecycle::runTest"
EXAMPLE = "test_optimistic.py::test_our_own_op_confirmed_in_turn_costs_no_rebase"


def collected(mark: str) -> set[str]:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            mark,
            *FILES,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return {line.strip() for line in run.stdout.splitlines() if "::" in line}


def test_hypothesis_driven_tests_are_property_and_not_unit() -> None:
    unit, prop = collected("unit"), collected("property")
    assert unit
    assert prop
    assert unit.isdisjoint(prop)
    assert any(node.endswith(STATE_MACHINE) for node in prop)
    assert any(node.endswith(LIFECYCLE) for node in prop)
    assert any(node.endswith(EXAMPLE) for node in unit)
    # tests/mutations/test_ops.py holds both kinds: its @given tests are property ones.
    ops = [node for node in unit | prop if "test_ops.py" in node]
    assert any(node in prop for node in ops)
    assert any(node in unit for node in ops)


def test_every_collected_test_of_these_files_has_exactly_one_cost() -> None:
    every = collected("unit or property or contract or integration or acceptance")
    assert every == collected("unit") | collected("property")
