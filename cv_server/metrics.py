"""Counters for `/metrics` (Prometheus text exposition format)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from cv_server.oplog import Committed, Outcome

__all__ = ["Metrics"]


class Metrics:
    def __init__(self) -> None:
        self.ops_committed = 0
        self.ops_duplicate = 0
        self.ops_rejected = 0
        self.ws_too_slow = 0
        #: Requests refused 429 `rate_limited`, by route class.
        self.rate_limited: Counter[str] = Counter()
        self.subscriptions_refused = 0
        self.gauges: dict[str, Callable[[], float]] = {}

    def record_outcomes(self, outcomes: Iterable[Outcome]) -> None:
        for outcome in outcomes:
            if outcome.duplicate:
                self.ops_duplicate += 1
            elif isinstance(outcome, Committed):
                self.ops_committed += 1
            else:
                self.ops_rejected += 1

    def count_too_slow(self) -> None:
        self.ws_too_slow += 1

    def count_rate_limited(self, route_class: str) -> None:
        self.rate_limited[route_class] += 1

    def count_subscription_refused(self) -> None:
        self.subscriptions_refused += 1

    def render(self) -> str:
        lines = [
            "# TYPE cv_ops_committed_total counter",
            f"cv_ops_committed_total {self.ops_committed}",
            "# TYPE cv_ops_duplicate_total counter",
            f"cv_ops_duplicate_total {self.ops_duplicate}",
            "# TYPE cv_ops_rejected_total counter",
            f"cv_ops_rejected_total {self.ops_rejected}",
            "# TYPE cv_ws_closed_too_slow_total counter",
            f"cv_ws_closed_too_slow_total {self.ws_too_slow}",
            "# TYPE cv_rate_limited_total counter",
            *(
                f'cv_rate_limited_total{{route_class="{cls}"}} {n}'
                for cls, n in sorted(self.rate_limited.items())
            ),
            "# TYPE cv_subscriptions_refused_total counter",
            f"cv_subscriptions_refused_total {self.subscriptions_refused}",
        ]
        for name, read in sorted(self.gauges.items()):
            lines += [f"# TYPE {name} gauge", f"{name} {read()}"]
        return "\n".join(lines) + "\n"
