"""The operator dashboard in headless Chromium, against the real server on loopback: it loads with
a token from the URL fragment, streams ops committed through the SDK, and its replay and cancel
buttons drive the queue. Every wait is on a DOM condition, bounded; nothing sleeps."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from cv_mutations import fingerprint, new_op_id, parse_op
from cv_server.auth import mint_token
from cv_server.oplog import IncomingOp
from cv_server.sqlite.oplog import SQLiteOpLogStore
from cv_workspace_client import WorkspaceClient
from tests.browser.conftest import SECRET, WS, Browser, dashboard_url, token_for

WORKER_CLASS = "browser-test"
POISON_CLASS = "browser-test-poison"


def insert(node_id: str) -> dict[str, Any]:
    return {"type": "node.insert", "node_id": node_id, "parent_id": "root", "op_id": new_op_id()}


@pytest.fixture
async def sdk(server: TestServer, tmp_path: Path) -> AsyncIterator[WorkspaceClient]:
    url = str(server.make_url("")).rstrip("/")
    async with WorkspaceClient(url, token=token_for(WS), outbox=tmp_path / "outbox") as client:
        yield client


@pytest.fixture
async def http(server: TestServer) -> AsyncIterator[aiohttp.ClientSession]:
    headers = {"Authorization": f"Bearer {token_for(WS)}"}
    async with aiohttp.ClientSession(str(server.make_url("")), headers=headers) as session:
        yield session


async def call(http: aiohttp.ClientSession, method: str, path: str, **body: Any) -> Any:
    async with http.request(method, path, json=body or None) as resp:
        assert resp.status < 300, await resp.text()
        return None if resp.status == 204 else await resp.json()


async def enqueue(
    http: aiohttp.ClientSession, worker_class: str = WORKER_CLASS, **extra: Any
) -> str:
    body = {"stage": "summarize", "worker_class": worker_class, "input": {"n": 1}, **extra}
    answer = await call(http, "POST", f"/v1/workspaces/{WS}/requests", **body)
    request_id: str = answer["request_id"]
    return request_id


async def claim(
    http: aiohttp.ClientSession, request_id: str, worker_class: str = WORKER_CLASS
) -> str:
    answer = await call(
        http, "POST", "/v1/queue/claim", worker_classes=[worker_class], worker_id="test-worker"
    )
    assert answer is not None, "nothing to claim"
    assert answer["request"]["request_id"] == request_id
    token: str = answer["request"]["claim_token"]
    return token


async def poisoned(http: aiohttp.ClientSession) -> str:
    """A request that failed on its one allowed attempt: poison, with its error kept. (Of a
    worker class of its own, so that other requests of a test never stand in its claim's way.)"""
    request_id = await enqueue(http, POISON_CLASS, max_dequeues=1)
    token = await claim(http, request_id, POISON_CLASS)
    error = {"code": "provider_down", "message": "the model provider answered 503"}
    answer = await call(
        http,
        "POST",
        f"/v1/workspaces/{WS}/requests/{request_id}/fail",
        claim_token=token,
        error=error,
    )
    assert answer["status"] == "poison"
    return request_id


async def open_dashboard(browser: Browser, server: TestServer, **fragment: str) -> None:
    await browser.call("goto", url=dashboard_url(server, token_for(WS), **fragment))
    await browser.wait('#status[data-state="live"]')
    await browser.wait('body[data-loaded="true"]', state="attached")


def row(request_id: str, status: str) -> str:
    return f'#queue tr[data-request-id="{request_id}"][data-status="{status}"]'


async def confirm(browser: Browser, row_selector: str, action: str) -> None:
    """Click `action` on the row, then confirm it: the page asks before it acts."""
    await browser.call("click", selector=f"{row_selector} button.{action}", timeout=10_000)
    await browser.call(
        "click", selector=f'{row_selector} button.{action}[data-confirm="true"]', timeout=10_000
    )


async def test_the_page_loads_with_a_token_and_shows_docs_locks_and_queue(
    browser: Browser,
    server: TestServer,
    sdk: WorkspaceClient,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    await sdk.apply_ops(WS, "tree", [insert("a"), insert("b")])
    await sdk.apply_op(WS, "notes", insert("n"))
    won = await call(
        http,
        "POST",
        f"/v1/workspaces/{WS}/locks/acquire",
        job_id="job-7",
        task="eval:salary",
        holder="worker-3",
    )
    assert won["acquired"]
    pending = await enqueue(http)
    poison = await poisoned(http)

    await open_dashboard(browser, server)
    await browser.wait('#docs tr[data-sub-doc="tree"][data-clock="2"]')
    await browser.wait('#docs tr[data-sub-doc="notes"][data-clock="1"]')
    await browser.wait('#locks tr[data-lock="job-7/eval:salary"]')
    assert "worker-3" in await browser.call(
        "text", selector='#locks tr[data-lock="job-7/eval:salary"]'
    )
    await browser.wait(row(pending, "pending") + " button.cancel")
    await browser.wait(row(poison, "poison") + " button.replay")
    error = await browser.call("text", selector=row(poison, "poison") + " td.error")
    assert error == "provider_down: the model provider answered 503"
    # The token left the address bar as soon as the page read it.
    href: str = await browser.call("evaluate", source="() => location.href")
    assert "token" not in href
    assert href.endswith(f"#ws={WS}")

    shot = tmp_path / "dashboard.png"
    await browser.call("screenshot", path=str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_an_op_committed_through_the_sdk_appears_in_the_live_stream_within_a_second(
    browser: Browser, server: TestServer, sdk: WorkspaceClient
) -> None:
    first = await sdk.apply_op(WS, "tree", insert("a"))
    await open_dashboard(browser, server)
    # Subscribed: the op committed before the page loaded is there as context.
    await browser.wait(f'#ops li[data-op-id="{first.op_id}"]')

    op = insert("b")
    committed = await sdk.apply_op(WS, "tree", op)
    started = time.monotonic()
    await browser.wait(
        f'#ops li[data-op-id="{op["op_id"]}"][data-clock="{committed.clock}"]', timeout_ms=1000
    )
    assert time.monotonic() - started < 1.0 + 0.5  # the wait's own bound, plus one round trip
    await browser.wait(
        f'#docs tr[data-sub-doc="tree"][data-clock="{committed.clock}"]', timeout_ms=1000
    )


async def test_a_sub_doc_written_after_the_page_loaded_joins_the_stream(
    browser: Browser, server: TestServer, sdk: WorkspaceClient
) -> None:
    await sdk.apply_op(WS, "tree", insert("a"))
    await open_dashboard(browser, server, refresh="0.5")
    op = insert("x")
    await sdk.apply_op(WS, "fresh", op)
    await browser.wait(f'#ops li[data-op-id="{op["op_id"]}"][data-sub-doc="fresh"]')
    await browser.wait('#docs tr[data-sub-doc="fresh"][data-clock="1"]')


async def test_the_replay_button_re_drives_a_poisoned_request_to_done(
    browser: Browser, server: TestServer, http: aiohttp.ClientSession
) -> None:
    request_id = await poisoned(http)
    await open_dashboard(browser, server)
    await confirm(browser, row(request_id, "poison"), "replay")
    await browser.wait(row(request_id, "pending"))
    stored = await call(http, "GET", f"/v1/workspaces/{WS}/requests/{request_id}")
    assert stored["status"] == "pending"

    token = await claim(http, request_id, POISON_CLASS)
    await call(
        http,
        "POST",
        f"/v1/workspaces/{WS}/requests/{request_id}/complete",
        claim_token=token,
        result={"summary": "ok"},
    )
    # It left the live listings while the page watched: shown with its final status.
    await browser.wait(row(request_id, "done"))


async def test_the_discard_button_asks_first_then_deletes_a_poisoned_request(
    browser: Browser, server: TestServer, http: aiohttp.ClientSession
) -> None:
    request_id = await poisoned(http)
    await open_dashboard(browser, server)
    poison = row(request_id, "poison")
    await browser.wait(f"{poison} button.replay")
    # The first click only asks, with "keep" beside it; "keep" takes the question back.
    await browser.call("click", selector=f"{poison} button.discard", timeout=10_000)
    await browser.wait(f'{poison} button.discard[data-confirm="true"]')
    await browser.call("click", selector=f"{poison} button.keep", timeout=10_000)
    await browser.wait(f'{poison} button.discard:not([data-confirm="true"])')
    stored = await call(http, "GET", f"/v1/workspaces/{WS}/requests/{request_id}")
    assert stored["status"] == "poison"  # nothing was sent

    await confirm(browser, poison, "discard")
    await browser.wait(row(request_id, "discarded"))
    resp = await http.get(f"/v1/workspaces/{WS}/requests/{request_id}")
    assert resp.status == 404
    assert await browser.call("count", selector=f"{row(request_id, 'discarded')} button") == 0


def _has_cancel_route(server: TestServer) -> bool:
    return any(
        resource.canonical == "/v1/workspaces/{ws}/requests/{id}/cancel"
        for resource in server.app.router.resources()
    )


async def test_the_cancel_button_cancels_a_pending_request(
    browser: Browser, server: TestServer, http: aiohttp.ClientSession
) -> None:
    if not _has_cancel_route(server):
        pytest.skip("this server has no cancel route yet (POST .../requests/{id}/cancel)")
    request_id = await enqueue(http)
    await open_dashboard(browser, server)
    await confirm(browser, row(request_id, "pending"), "cancel")
    await browser.wait(row(request_id, "cancelled"))
    stored = await call(http, "GET", f"/v1/workspaces/{WS}/requests/{request_id}")
    assert stored["status"] == "cancelled"


async def test_a_refused_token_is_reported_and_nothing_is_shown(
    browser: Browser, server: TestServer, sdk: WorkspaceClient
) -> None:
    await sdk.apply_op(WS, "tree", insert("a"))
    await browser.call("goto", url=dashboard_url(server, token_for("ws2"), ws=WS))
    await browser.wait('#status[data-state="error"]')
    assert await browser.call("text", selector="#status") == "workspace not granted"
    assert await browser.call("count", selector="#docs tr[data-sub-doc]") == 0
    # The failed calls were the server's 403s, which the page reports; no script error.
    problems = await browser.problems()
    assert all("403" in problem for problem in problems), problems


def scoped_token(*scopes: str) -> str:
    return mint_token(SECRET, [WS], now=time.time(), scopes=scopes)


async def test_a_read_only_token_sees_docs_and_ops_but_no_queue_and_no_operator_buttons(
    browser: Browser, server: TestServer, sdk: WorkspaceClient, http: aiohttp.ClientSession
) -> None:
    first = await sdk.apply_op(WS, "tree", insert("a"))
    await poisoned(http)
    await enqueue(http)
    await browser.call("goto", url=dashboard_url(server, scoped_token("read"), refresh="0.5"))
    await browser.wait('#status[data-state="live"]')
    await browser.wait(f'#ops li[data-op-id="{first.op_id}"]')
    await browser.wait('#docs tr[data-sub-doc="tree"]')
    await browser.wait("#queue-not-allowed")
    assert (
        await browser.call("text", selector="#queue-not-allowed")
        == "this token cannot operate the queue (scope operate)"
    )
    await browser.wait("#locks-not-allowed")
    # Refreshes went by with no queue listing: no row, so no replay, discard or cancel.
    before = await browser.call("evaluate", source="() => window.cvDashboard.refreshes()")
    await browser.call(
        "waitFunction",
        source="(n) => window.cvDashboard.refreshes() >= n + 2",
        arg=before,
        timeout=10_000,
    )
    assert await browser.call("count", selector="#queue button") == 0
    assert await browser.call("count", selector="#queue tr[data-request-id]") == 0
    assert await browser.call("text", selector="#error") == ""


async def test_an_operate_token_gets_the_operator_buttons_and_is_told_it_cannot_read(
    browser: Browser, server: TestServer, sdk: WorkspaceClient, http: aiohttp.ClientSession
) -> None:
    await sdk.apply_op(WS, "tree", insert("a"))
    poison = await poisoned(http)
    pending = await enqueue(http)
    await browser.call("goto", url=dashboard_url(server, scoped_token("operate")))
    await browser.wait(row(poison, "poison") + " button.replay")
    await browser.wait(row(poison, "poison") + " button.discard")
    await browser.wait(row(pending, "pending") + " button.cancel")
    await browser.wait('#status[data-state="live"]')
    assert await browser.call("count", selector="#queue-not-allowed:not([hidden])") == 0
    assert (
        await browser.call("text", selector="#ops-not-allowed")
        == "this token cannot read live ops (scope read)"
    )
    assert await browser.call("count", selector="#docs tr[data-sub-doc]") == 0
    assert await browser.call("text", selector="#error") == ""


async def test_the_commit_rate_chart_draws_the_workspace_s_commits(
    browser: Browser, server: TestServer, sdk: WorkspaceClient
) -> None:
    await sdk.apply_op(WS, "tree", insert("seed"))
    await open_dashboard(browser, server, refresh="0.5")
    await sdk.apply_ops(WS, "tree", [insert(f"n{i}") for i in range(20)])
    await browser.call(
        "waitFunction",
        # A point above the chart's zero line (y = 76 of 90): it stays on the chart for 60
        # refreshes, whereas the figure under it shows only the last interval's rate.
        source="""() => [...document.querySelectorAll("#chart-commit-rate polyline")].some(
            (line) => line.getAttribute("points").split(" ").some(
                (point) => Number(point.split(",")[1]) < 76))""",
        timeout=10_000,
    )


#: What a Prometheus client library writes for two histograms (the families the server exports
#: for queue wait and stage wall time), buckets left out: the page reads `_sum` and `_count`.
METRICS_BEFORE = """\
# HELP cv_queue_wait_seconds Enqueue to claim.
# TYPE cv_queue_wait_seconds histogram
cv_queue_wait_seconds_bucket{le="+Inf"} 4.0
cv_queue_wait_seconds_sum 2.0
cv_queue_wait_seconds_count 4.0
# TYPE cv_stage_seconds histogram
cv_stage_seconds_sum{stage="evaluate"} 10.0
cv_stage_seconds_count{stage="evaluate"} 5.0
cv_stage_seconds_sum{stage="say \\"hi\\""} 1.0
cv_stage_seconds_count{stage="say \\"hi\\""} 1.0
cv_stage_seconds_created{stage="evaluate"} 1.7e+09
"""
METRICS_AFTER = (
    METRICS_BEFORE.replace("_sum 2.0", "_sum 5.0")
    .replace("wait_seconds_count 4.0", "wait_seconds_count 6.0")
    .replace('"evaluate"} 10.0', '"evaluate"} 16.0')
    .replace('"evaluate"} 5.0', '"evaluate"} 7.0')
    # A stage first run in the interval: its series did not exist before.
    + 'cv_stage_seconds_sum{stage="new"} 3.0\ncv_stage_seconds_count{stage="new"} 2.0\n'
)


async def test_the_charts_read_interval_means_from_prometheus_histograms(
    browser: Browser, server: TestServer
) -> None:
    await browser.call("goto", url=str(server.make_url("/dashboard")))
    means = await browser.call(
        "evaluate",
        source="""([before, after]) => {
            const d = window.cvDashboard;
            const read = (text) => ({
                wait: d.histogramTotals(d.parsePrometheus(text), "cv_queue_wait_seconds", null),
                stages: d.histogramTotals(d.parsePrometheus(text), "cv_stage_seconds", "stage"),
            });
            const [a, b] = [read(before), read(after)];
            return {
                wait: d.intervalMean(a.wait.get("all"), b.wait.get("all")),
                evaluate: d.intervalMean(a.stages.get("evaluate"), b.stages.get("evaluate")),
                quiet: d.intervalMean(a.stages.get('say "hi"'), b.stages.get('say "hi"')),
                fresh: d.intervalMean(a.stages.get("new"), b.stages.get("new")),
                stages: [...b.stages.keys()].sort(),
            };
        }""",
        arg=[METRICS_BEFORE, METRICS_AFTER],
    )
    assert means == {
        "wait": (5.0 - 2.0) / (6 - 4),
        "evaluate": (16.0 - 10.0) / (7 - 5),
        "quiet": None,  # nothing observed in the interval: a gap, not a zero
        "fresh": 3.0 / 2,
        "stages": ["evaluate", "new", 'say "hi"'],
    }


async def test_the_queue_wait_and_stage_charts_draw_what_the_server_exports(
    browser: Browser, server: TestServer, http: aiohttp.ClientSession
) -> None:
    async with http.get("/metrics") as resp:
        exported = await resp.text()
    if "cv_queue_wait_seconds" not in exported or "cv_stage_seconds" not in exported:
        pytest.skip("this server exports no queue-wait and stage histograms on /metrics")
    await open_dashboard(browser, server, refresh="0.5")
    for stage in ("evaluate", "summarize"):
        body = {"stage": stage, "worker_class": WORKER_CLASS}
        answer = await call(http, "POST", f"/v1/workspaces/{WS}/requests", **body)
        token = await claim(http, answer["request_id"])
        path = f"/v1/workspaces/{WS}/requests/{answer['request_id']}/complete"
        await call(http, "POST", path, claim_token=token, result={"ok": True})
    await browser.call(
        "waitFunction",
        source="""() => {
            const wait = document.getElementById("value-queue-wait").textContent;
            const stages = document.getElementById("value-stage-wall").textContent;
            return /^[0-9.e-]+ s$/.test(wait)
                && stages.includes("evaluate") && stages.includes("summarize");
        }""",
        timeout=10_000,
    )
    legend = await browser.call(
        "evaluate",
        source="""() => [...document.querySelectorAll("#chart-stage-wall text")]
            .map((t) => t.textContent).filter((t) => /[a-z]/.test(t)).sort()""",
    )
    assert legend == ["evaluate", "summarize"]


# -- a link pasted into an open tab (hashchange) --------------------------------------------------

OTHER_WS = "ws2"


async def test_a_link_pasted_into_an_open_tab_switches_workspace_and_hides_its_token(
    browser: Browser, server: TestServer, sdk: WorkspaceClient, tmp_path: Path
) -> None:
    await sdk.apply_op(WS, "tree", insert("a"))
    other_token = token_for(OTHER_WS)
    url = str(server.make_url("")).rstrip("/")
    async with WorkspaceClient(url, token=other_token, outbox=tmp_path / "other") as other:
        await other.apply_op(OTHER_WS, "elsewhere", insert("x"))
        await open_dashboard(browser, server)
        await browser.wait('#docs tr[data-sub-doc="tree"]')

        # What pasting `/dashboard#token=...&ws=ws2` into the address bar of this tab does: the
        # fragment changes, the page does not load again.
        await browser.call(
            "evaluate",
            source="(hash) => { location.hash = hash; }",
            arg=f"token={other_token}&ws={OTHER_WS}",
        )
        await browser.wait('#docs tr[data-sub-doc="elsewhere"]')
        await browser.wait('#status[data-state="live"]')
        assert await browser.call("count", selector='#docs tr[data-sub-doc="tree"]') == 0
        href: str = await browser.call("evaluate", source="() => location.href")
        assert "token" not in href
        assert href.endswith(f"#ws={OTHER_WS}")
        assert await browser.call("evaluate", source="() => workspace.value") == OTHER_WS
        stored = await browser.call(
            "evaluate", source='() => sessionStorage.getItem("cv-dashboard-token")'
        )
        assert stored == other_token

        # The live stream follows: the new workspace's ops appear, the old one's do not.
        await sdk.apply_op(WS, "tree", old := insert("old-workspace"))
        await other.apply_op(OTHER_WS, "elsewhere", new := insert("new-workspace"))
        await browser.wait(f'#ops li[data-op-id="{new["op_id"]}"]')
        assert await browser.call("count", selector=f'#ops li[data-op-id="{old["op_id"]}"]') == 0


# -- commit times, catch-up apart from live -------------------------------------------------------


async def test_the_live_stream_shows_commit_times_and_marks_catch_up_apart_from_live(
    browser: Browser, server: TestServer, sdk: WorkspaceClient, tmp_path: Path
) -> None:
    # An op committed ten minutes ago, in the server's own database file (a sub-doc the running
    # server has not touched, so its cache holds nothing of it).
    ten_minutes_ago = time.time() - 600
    store = await SQLiteOpLogStore.open(tmp_path / "cv.db", now=lambda: ten_minutes_ago)
    op = insert("old")
    await store.append(WS, "archive", [IncomingOp(parse_op(op), op, fingerprint(op))])
    await store.close()

    await open_dashboard(browser, server)
    old = f'#ops li[data-op-id="{op["op_id"]}"]'
    await browser.wait(old)
    assert await browser.call("evaluate", source=f"() => {attr(old, 'kind')}") == "catch-up"
    committed_at = float(await browser.call("evaluate", source=f"() => {attr(old, 'committedAt')}"))
    assert committed_at == pytest.approx(ten_minutes_ago, abs=0.001)
    shown = await browser.call("text", selector=f"{old} .time")
    expected = await browser.call(
        "evaluate",
        source="(at) => new Date(at * 1000).toLocaleTimeString()",
        arg=committed_at,
    )
    assert shown.strip() == expected
    assert "catch-up" in await browser.call("text", selector=f"{old} .kind")

    live_op = insert("new")
    await sdk.apply_op(WS, "archive", live_op)
    live = f'#ops li[data-op-id="{live_op["op_id"]}"]'
    await browser.wait(live)
    assert await browser.call("evaluate", source=f"() => {attr(live, 'kind')}") == "live"
    at = float(await browser.call("evaluate", source=f"() => {attr(live, 'committedAt')}"))
    assert abs(at - time.time()) < 60
    _, logged = await sdk.read_ops(WS, "archive")
    assert [e.committed_at for e in logged] == pytest.approx([committed_at, at], abs=0.001)


def attr(selector: str, name: str) -> str:
    """JS reading `dataset[name]` of the first match of `selector`."""
    return f"document.querySelector({selector!r}).dataset.{name}"


# -- cancel and replay ask first -------------------------------------------------------------------


async def test_cancel_asks_for_confirmation_and_does_nothing_until_confirmed(
    browser: Browser, server: TestServer, http: aiohttp.ClientSession
) -> None:
    if not _has_cancel_route(server):
        pytest.skip("this server has no cancel route yet (POST .../requests/{id}/cancel)")
    request_id = await enqueue(http)
    await open_dashboard(browser, server, refresh="0.5")
    pending = row(request_id, "pending")
    await browser.call("click", selector=f"{pending} button.cancel", timeout=10_000)
    asking = f'{pending} button.cancel[data-confirm="true"]'
    await browser.wait(asking)
    assert await browser.call("text", selector=asking) == "Confirm cancel?"
    # The question outlives the page's refreshes (the table is redrawn on each).
    before = await browser.call("evaluate", source="() => window.cvDashboard.refreshes()")
    await browser.call(
        "waitFunction",
        source="(n) => window.cvDashboard.refreshes() >= n + 2",
        arg=before,
        timeout=10_000,
    )
    await browser.wait(asking)
    stored = await call(http, "GET", f"/v1/workspaces/{WS}/requests/{request_id}")
    assert (stored["status"], stored["cancel_requested"]) == ("pending", False)

    # Backing out leaves it alone and the button as it was.
    await browser.call("click", selector=f"{pending} button.keep", timeout=10_000)
    await browser.wait(f'{pending} button.cancel:not([data-confirm="true"])')
    assert await browser.call("count", selector=f"{pending} button.keep") == 0
    stored = await call(http, "GET", f"/v1/workspaces/{WS}/requests/{request_id}")
    assert stored["status"] == "pending"

    await confirm(browser, pending, "cancel")
    await browser.wait(row(request_id, "cancelled"))


async def test_replay_asks_for_confirmation_before_it_re_queues(
    browser: Browser, server: TestServer, http: aiohttp.ClientSession
) -> None:
    request_id = await poisoned(http)
    await open_dashboard(browser, server)
    poison = row(request_id, "poison")
    await browser.call("click", selector=f"{poison} button.replay", timeout=10_000)
    asking = f'{poison} button.replay[data-confirm="true"]'
    await browser.wait(asking)
    assert await browser.call("text", selector=asking) == "Confirm replay?"
    stored = await call(http, "GET", f"/v1/workspaces/{WS}/requests/{request_id}")
    assert stored["status"] == "poison"
    await browser.call("click", selector=asking, timeout=10_000)
    await browser.wait(row(request_id, "pending"))


async def test_the_schedules_panel_shows_the_next_firing_the_last_and_its_request(
    browser: Browser, server: TestServer, http: aiohttp.ClientSession
) -> None:
    base = f"/v1/workspaces/{WS}/schedules"
    await call(http, "POST", base, name="nightly", cron="0 3 * * *", enqueue={"stage": "s"})
    await call(
        http, "POST", base, name="held", interval_seconds=60, enqueue={"stage": "s"}, paused=True
    )
    ran = await call(http, "POST", f"{base}/held/run")

    await open_dashboard(browser, server)
    await browser.wait('#schedules tr[data-schedule="nightly"]')
    nightly = await browser.call("text", selector='#schedules tr[data-schedule="nightly"]')
    assert "0 3 * * *" in nightly
    assert "in " in nightly  # its next firing, from now
    assert "never" in nightly
    held = await browser.call("text", selector='#schedules tr[data-schedule="held"]')
    assert "every 60s" in held
    assert "paused" in held
    assert ran["request_id"] in held  # its last firing's request
    assert "ago" in held
