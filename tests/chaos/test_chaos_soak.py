"""The chaos soak's bounded profile, on both backends, every run of the suite: at least 50
process kills and 500 cut connections per backend, and every invariant holding
(`tests.chaos.invariants`: 0 duplicates, 0 lost acknowledged ops, gap-free clocks, each
subscriber saw each clock once in order, every request ended once, the provider paid once per
cell, every outbox empty). The schedule's seed is fixed, so a failure repeats with
`python -m tests.chaos --backend B --seconds 75 --seed S`."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest

from cv_server.cli import _with_schema
from tests.chaos.harness import Backend, ChaosResult, ChaosSpec, run_chaos
from tests.pg.helpers import fresh_schema

pytestmark = [pytest.mark.acceptance, pytest.mark.timeout(600)]

SECONDS: Final = 75.0
SEEDS: Final[dict[Backend, int]] = {"sqlite": 23, "postgres": 2323}
MIN_KILLS: Final = 50
MIN_CUTS: Final = 500


def _judge(result: ChaosResult) -> None:
    print(result.figure_line)
    figures = result.verdict.figures
    log = "\n".join(result.history.fault_log)
    assert result.verdict.ok, f"{result.verdict.violations}\nfault log:\n{log}"
    assert figures["duplicates"] == 0
    assert figures["lost"] == 0
    assert figures["kills"] >= MIN_KILLS, result.figure_line
    assert figures["cut_connections"] >= MIN_CUTS, result.figure_line
    # The faults landed while there was work: ops and stage requests were acknowledged.
    assert figures["acknowledged"] > 0
    assert figures["done"] > 0


#: The workers' transports: their worker channel (the default), and the HTTP verbs.
TRANSPORTS: Final = ["channel", "http"]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_chaos_soak_on_sqlite(tmp_path: Path, transport: str) -> None:
    spec = ChaosSpec(
        backend="sqlite",
        seconds=SECONDS,
        seed=SEEDS["sqlite"],
        workdir=tmp_path,
        worker_transport=transport,
    )
    _judge(await run_chaos(spec))


@pytest.mark.postgres
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_chaos_soak_on_three_postgres_instances(
    tmp_path: Path, postgres_url: str, transport: str
) -> None:
    async with fresh_schema(postgres_url) as schema:
        spec = ChaosSpec(
            backend="postgres",
            seconds=SECONDS,
            seed=SEEDS["postgres"],
            workdir=tmp_path,
            database_url=_with_schema(postgres_url, schema),
            worker_transport=transport,
        )
        _judge(await run_chaos(spec))
