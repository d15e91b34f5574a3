"""Reading `/metrics` the way Prometheus does: with `prometheus_client`'s own text parser."""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Samples", "parse", "scrape"]


class Samples:
    """The samples of one scrape: `samples["cv_ops_rejected_total", {"code": "x"}]`, 0.0 for a
    series that was not exported (a counter never incremented)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.values: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        self.helps: dict[str, str] = {}
        self.types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            self.helps[family.name] = family.documentation
            self.types[family.name] = family.type
            for sample in family.samples:
                self.values[sample.name, frozenset(sample.labels.items())] = sample.value

    def __getitem__(self, key: str | tuple[str, dict[str, str]]) -> float:
        name, labels = (key, {}) if isinstance(key, str) else key
        return self.values.get((name, frozenset(labels.items())), 0.0)

    def total(self, name: str, **labels: str) -> float:
        """The sum of every series of `name` whose labels include `labels`."""
        wanted = set(labels.items())
        return sum(
            value
            for (sample, have), value in self.values.items()
            if sample == name and wanted <= have
        )

    def names(self) -> set[str]:
        return {name for name, _ in self.values}


def parse(text: str) -> Samples:
    return Samples(text)


async def scrape(client: TestClient[Any, Any]) -> Samples:
    response = await client.get("/metrics")
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return Samples(await response.text())
