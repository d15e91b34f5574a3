// The operator dashboard (docs/dashboard.md): plain JS, no build step, nothing loaded from
// elsewhere. Every data call carries `Authorization: Bearer <token>`; the websocket passes the
// token as the `cv-bearer.<token>` subprotocol. The token never goes into a URL: it is read from
// the fragment (`#token=...`, which browsers never send), then the fragment is cleared, on load and
// whenever the fragment changes in an open tab (a link pasted into its address bar).
//
// Everything the server sends is rendered with textContent, never as HTML: op payloads, holder
// names and error messages are whatever clients wrote.
"use strict";

(() => {
  // Refresh period of the listings and charts: 2 s, the ceiling of a worker's idle poll, so the
  // page sees queue changes about as soon as an idle worker would. `#refresh=<s>` overrides it.
  const DEFAULT_REFRESH_S = 2;
  // Reconnect delays of the live stream: the SDK's client retry schedule (full jitter, base 1 s,
  // cap 300 s), without its attempt limit: a dashboard keeps trying until it is closed.
  const RETRY_BASE_S = 1;
  const RETRY_CAP_S = 300;
  const MAX_OPS_SHOWN = 200; // the live stream keeps its newest lines only
  const MAX_FINISHED_SHOWN = 10; // requests seen finishing while the page watched
  // A replay, discard or cancel asks first; unanswered, the question lapses after this long.
  const CONFIRM_S = 10;
  const CHART_POINTS = 60;
  // The queue-wait and stage charts plot the mean over the last few refreshes, not the last one
  // alone: at a refresh of 2 s, most single intervals see no run of a given stage finish.
  const MEAN_WINDOW = 5;
  const PAGE = 1000; // the routes' largest page
  const LIVE_STATUSES = ["pending", "in_progress", "poison"];
  const SUBPROTOCOL = "cv-workspace.v1";
  const BEARER_PREFIX = "cv-bearer.";
  const COLORS = ["#2f6fdf", "#c0392b", "#1f8a4c", "#b26b00", "#7b4fc9", "#0f8b8d"];

  const $ = (id) => document.getElementById(id);

  // -- pure helpers (no DOM, no I/O) ------------------------------------------------------------

  /** Parse Prometheus text exposition into [{name, labels, value}]. */
  function parsePrometheus(text) {
    const samples = [];
    const line = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/;
    const label = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
    for (const raw of text.split("\n")) {
      if (!raw || raw.startsWith("#")) continue;
      const m = line.exec(raw);
      if (!m) continue;
      const labels = {};
      if (m[3]) for (const l of m[3].matchAll(label)) labels[l[1]] = l[2].replace(/\\(.)/g, "$1");
      samples.push({ name: m[1], labels, value: Number(m[4]) });
    }
    return samples;
  }

  /** Sum of a family's `_sum` and `_count` by one label (or all together when `by` is null). */
  function histogramTotals(samples, family, by) {
    const totals = new Map();
    for (const s of samples) {
      const part = s.name === `${family}_sum` ? "sum" : s.name === `${family}_count` ? "count" : null;
      if (!part) continue;
      const key = by ? s.labels[by] ?? "" : "all";
      const t = totals.get(key) || { sum: 0, count: 0 };
      t[part] += s.value;
      totals.set(key, t);
    }
    return totals;
  }

  /** Mean of the observations made between two readings of a histogram (null: none made). A
   * series missing from the first reading had none yet: a client library exports a labelled
   * series from its first observation on. */
  function intervalMean(before, after) {
    if (!after) return null;
    before = before || { sum: 0, count: 0 };
    const count = after.count - before.count;
    return count > 0 ? (after.sum - before.sum) / count : null;
  }

  /** The token's payload, read without the secret: it is the page's own token, and the server
   * still checks every call; this only decides what the page offers. {} when unreadable. */
  function decodeTokenPayload(token) {
    try {
      const body = token.split(".")[1].replace(/-/g, "+").replace(/_/g, "/");
      const payload = JSON.parse(atob(body + "=".repeat((4 - (body.length % 4)) % 4)));
      return payload && typeof payload === "object" ? payload : {};
    } catch {
      return {};
    }
  }

  function decodeTokenWorkspaces(token) {
    const payload = decodeTokenPayload(token);
    return Array.isArray(payload.ws) ? payload.ws : [];
  }

  /** The scopes the token names (`sc`), or null for every scope: a token minted before scopes
   * existed, or one whose payload cannot be read (docs/operating.md, "Tokens and scopes"). */
  function decodeTokenScopes(token) {
    const scopes = decodeTokenPayload(token).sc;
    return Array.isArray(scopes) && scopes.every((s) => typeof s === "string") ? scopes : null;
  }

  function formatAge(seconds) {
    if (seconds == null || !Number.isFinite(seconds)) return "–";
    const s = Math.max(0, seconds);
    if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
    return `${Math.floor(s / 86400)} d`;
  }

  /** The smallest of 1, 2, 5 × 10^k at or above `value`: a chart's top line. */
  function niceCeil(value) {
    if (!(value > 0)) return 1;
    const power = 10 ** Math.floor(Math.log10(value));
    for (const step of [1, 2, 5, 10]) if (step * power >= value) return step * power;
    return 10 * power;
  }

  function formatNumber(value) {
    if (value == null || !Number.isFinite(value)) return "–";
    if (value === 0) return "0";
    if (Math.abs(value) >= 100) return value.toFixed(0);
    if (Math.abs(value) >= 1) return value.toFixed(2);
    return value.toPrecision(2);
  }

  function errorText(error) {
    if (error == null) return "";
    if (typeof error === "string") return error;
    if (typeof error === "object" && typeof error.message === "string") {
      return error.code ? `${error.code}: ${error.message}` : error.message;
    }
    return JSON.stringify(error);
  }

  /** A commit time as the page shows it: the time of day, with the date when it is older than
   * half a day (catch-up can reach far back). */
  function commitTimeText(seconds) {
    const at = new Date(seconds * 1000);
    return Date.now() / 1000 - seconds > 43200 ? at.toLocaleString() : at.toLocaleTimeString();
  }

  function retryDelay(attempt) {
    return Math.random() * Math.min(RETRY_CAP_S, RETRY_BASE_S * 2 ** attempt);
  }

  // -- state ------------------------------------------------------------------------------------

  const state = {
    token: "",
    workspace: "",
    refreshS: DEFAULT_REFRESH_S,
    generation: 0, // bumped on each connect: stale timers and sockets of the last one stop
    skewS: 0, // server clock minus ours, estimated from the Date headers (see `observeDate`)
    skewBounds: null, // [low, high]: what the Date headers seen so far allow the skew to be
    socket: null,
    subscribed: new Map(), // sub_doc -> last clock seen
    // Sub-docs whose `synced` came on the current subscription: their ops are live; an op of
    // any other was committed before (catch-up, after a load or a reconnect).
    synced: new Set(),
    confirming: null, // {action, requestId, until}: the action a row's button asks to confirm
    refreshes: 0, // completed refreshes of this connection (window.cvDashboard.refreshes)
    docs: [],
    docsFetchedAt: 0,
    opsShown: 0,
    requests: new Map(), // request_id -> row, as last seen
    finished: new Map(), // request_id -> row that left the live listings while we watched
    locks: [],
    locksFetchedAt: 0,
    schedules: [],
    schedulesFetchedAt: 0,
    charts: {
      commitRate: { series: new Map() },
      queueWait: { series: new Map() },
      stageWall: { series: new Map() },
    },
    lastClockSum: null,
    metricsHistory: [], // the last MEAN_WINDOW + 1 readings of the histograms
    scopes: null, // the token's scopes (null: every scope), from its own payload
  };

  /** Whether the page's token carries `scope`: the page offers only what it allows. */
  const can = (scope) => state.scopes === null || state.scopes.includes(scope);

  /** Show, in each panel the token cannot use, why it is empty (and hide the note otherwise). */
  function renderAllowed() {
    const notes = {
      "docs-not-allowed": can("read") ? "" : "this token cannot read sub-docs (scope read)",
      "ops-not-allowed": can("read") ? "" : "this token cannot read live ops (scope read)",
      "queue-not-allowed": can("operate") ? "" : "this token cannot operate the queue (scope operate)",
      "locks-not-allowed": can("operate") ? "" : "this token cannot list compute locks (scope operate)",
      "schedules-not-allowed":
        can("enqueue") || can("operate") ? "" : "this token cannot list schedules (scope enqueue or operate)",
    };
    for (const [id, text] of Object.entries(notes)) {
      $(id).textContent = text;
      $(id).hidden = !text;
    }
  }

  function setStatus(kind, text) {
    const el = $("status");
    el.dataset.state = kind;
    el.textContent = text;
  }

  function showError(text) {
    $("error").textContent = text || "";
  }

  // -- HTTP -------------------------------------------------------------------------------------

  class ProblemError extends Error {
    constructor(status, code, detail) {
      super(`${status} ${code}${detail ? `: ${detail}` : ""}`);
      this.status = status;
      this.code = code;
    }
  }

  /** Narrow the estimate of the server's clock with one answer's `Date` header, sent at some
   * moment between our `sentAt` and `receivedAt` and truncated to the second: the skew is in
   * [date - receivedAt, date + 1 - sentAt]. Intersecting these bounds over many answers pins
   * it far better than to the second; bounds that stop overlapping (a clock was stepped) start
   * the estimate afresh. */
  function observeDate(header, sentAt, receivedAt) {
    const date = Date.parse(header || "") / 1000;
    if (!Number.isFinite(date)) return;
    const low = date - receivedAt;
    const high = date + 1 - sentAt;
    const bounds = state.skewBounds;
    if (bounds && low <= bounds[1] && high >= bounds[0]) {
      state.skewBounds = [Math.max(low, bounds[0]), Math.min(high, bounds[1])];
    } else {
      state.skewBounds = [low, high];
    }
    state.skewS = (state.skewBounds[0] + state.skewBounds[1]) / 2;
  }

  /** An answer that came after the page connected afresh (another workspace or token): it is
   * dropped, never rendered over what the page shows now. */
  class StaleAnswer extends Error {}

  async function api(path, options = {}) {
    const generation = state.generation;
    const sentAt = Date.now() / 1000;
    const response = await fetch(path, {
      method: options.method || "GET",
      headers: { Authorization: `Bearer ${state.token}`, Accept: "application/json" },
      cache: "no-store",
      credentials: "omit",
      referrerPolicy: "no-referrer",
    });
    observeDate(response.headers.get("Date"), sentAt, Date.now() / 1000);
    const text = await response.text();
    if (generation !== state.generation) throw new StaleAnswer(path);
    if (!response.ok) {
      let code = "http_error";
      let detail = text.slice(0, 200);
      try {
        const problem = JSON.parse(text);
        code = problem.code || code;
        detail = problem.detail || "";
      } catch {
        // not problem+json: keep the text
      }
      throw new ProblemError(response.status, code, detail);
    }
    return options.raw ? text : JSON.parse(text);
  }

  const wsPath = () => `/v1/workspaces/${encodeURIComponent(state.workspace)}`;
  const serverNow = () => Date.now() / 1000 + state.skewS;

  // -- sub-docs and the live stream -------------------------------------------------------------

  async function refreshDocs() {
    const page = await api(`${wsPath()}/docs?limit=${PAGE}`);
    state.docs = page.docs;
    state.docsFetchedAt = serverNow();
    $("docs-count").textContent = page.next_after ? `${PAGE}+` : String(page.docs.length);
    for (const doc of page.docs) {
      if (!state.subscribed.has(doc.sub_doc)) {
        // Found now: a sub-doc written since the page loaded streams from its first op; one that
        // was there at load shows its last few ops as context.
        const since = state.firstDocsLoaded ? 0 : Math.max(0, doc.clock - 5);
        subscribe(doc.sub_doc, since);
      }
    }
    state.firstDocsLoaded = true;
    renderDocs();
    const sum = page.docs.reduce((total, doc) => total + doc.clock, 0);
    // Rates on our own monotonic clock: the server's, as estimated, may be corrected between
    // two readings, which would stretch or shrink (even reverse) an interval.
    const now = performance.now() / 1000;
    if (state.lastClockSum) {
      const dt = now - state.lastClockSum.at;
      if (dt > 0) {
        const rate = Math.max(0, sum - state.lastClockSum.sum) / dt;
        pushPoint(state.charts.commitRate, "ops/s", rate);
        $("value-commit-rate").textContent = `${formatNumber(rate)} ops/s`;
      }
    }
    state.lastClockSum = { sum, at: now };
  }

  function renderDocs() {
    const body = $("docs").tBodies[0];
    const rows = state.docs.map((doc) => {
      const clock = Math.max(doc.clock, state.subscribed.get(doc.sub_doc) || 0);
      const tr = document.createElement("tr");
      tr.dataset.subDoc = doc.sub_doc;
      tr.dataset.clock = String(clock);
      const age = `${formatAge(serverNow() - doc.committed_at)} ago`;
      cells(tr, [doc.sub_doc, String(clock), String(doc.horizon ?? 1), age]);
      return tr;
    });
    body.replaceChildren(...rows);
  }

  function subscribe(subDoc, since) {
    state.subscribed.set(subDoc, since);
    const socket = state.socket;
    if (socket && socket.readyState === WebSocket.OPEN) sendSubscribe(socket, subDoc, since);
  }

  /** Every subscribe starts with catch-up: what it sends up to its `synced` is not live. */
  function sendSubscribe(socket, subDoc, since) {
    state.synced.delete(subDoc);
    socket.send(JSON.stringify({ type: "subscribe", sub_doc: subDoc, since }));
  }

  function openSocket(generation, attempt = 0) {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const url = `${scheme}//${location.host}${wsPath()}/socket`;
    const socket = new WebSocket(url, [SUBPROTOCOL, BEARER_PREFIX + state.token]);
    state.socket = socket;
    let opened = false;
    socket.addEventListener("open", () => {
      opened = true;
      setStatus("live", "live");
      for (const [subDoc, since] of state.subscribed) sendSubscribe(socket, subDoc, since);
    });
    socket.addEventListener("message", (event) => {
      // A socket replaced by a reconnect or a switch of workspace may still deliver what it had
      // buffered: none of it belongs to what the page shows now.
      if (state.socket !== socket) return;
      let frames;
      try {
        frames = JSON.parse(event.data);
      } catch {
        return;
      }
      for (const frame of Array.isArray(frames) ? frames : [frames]) onFrame(frame);
    });
    socket.addEventListener("close", (event) => {
      if (generation !== state.generation) return;
      state.socket = null;
      if (event.code === 4001 || event.code === 4003) {
        setStatus("error", event.code === 4001 ? "token refused" : "workspace not granted");
        showError(`live stream closed: ${event.code} ${event.reason}`);
        return;
      }
      const next = opened ? 0 : attempt + 1;
      const delay = retryDelay(next);
      setStatus("connecting", `reconnecting in ${delay.toFixed(1)} s`);
      setTimeout(() => generation === state.generation && openSocket(generation, next), delay * 1000);
    });
  }

  function onFrame(frame) {
    if (!frame || typeof frame !== "object") return;
    if (frame.type === "op") {
      const last = state.subscribed.get(frame.sub_doc) ?? 0;
      // A resubscribe after a reconnect asks from the last clock seen, so nothing is sent twice;
      // this check keeps it so should two subscriptions of one sub-doc ever overlap.
      if (frame.clock <= last) return;
      state.subscribed.set(frame.sub_doc, frame.clock);
      addOp(frame);
    } else if (frame.type === "snapshot") {
      // The ops before `clock` were compacted (docs/protocol.md): the feed resumes after it.
      const last = state.subscribed.get(frame.sub_doc) ?? 0;
      if (frame.clock > last) state.subscribed.set(frame.sub_doc, frame.clock);
    } else if (frame.type === "synced") {
      state.synced.add(frame.sub_doc);
    } else if (frame.type === "error") {
      showError(`live stream: ${frame.code}: ${frame.message}`);
    }
  }

  function addOp(frame) {
    const list = $("ops");
    const li = document.createElement("li");
    li.dataset.subDoc = frame.sub_doc;
    li.dataset.clock = String(frame.clock);
    if (frame.op_id) li.dataset.opId = frame.op_id;
    const live = state.synced.has(frame.sub_doc);
    li.dataset.kind = live ? "live" : "catch-up";
    // The commit time the server sent (Unix seconds); a server too old to send it leaves the
    // time of arrival, marked with a "~".
    const committedAt = Number.isFinite(frame.committed_at) ? frame.committed_at : null;
    if (committedAt != null) li.dataset.committedAt = String(committedAt);
    const time =
      committedAt != null ? commitTimeText(committedAt) : `~${new Date().toLocaleTimeString()}`;
    if (committedAt != null) li.title = `committed ${new Date(committedAt * 1000).toISOString()}`;
    const op = frame.op && typeof frame.op === "object" ? frame.op : {};
    const { type, op_id: _opId, ...fields } = op; // the type is shown, the op_id is the line's
    const parts = [
      ["time", time],
      ["kind", live ? " live " : " catch-up "],
      ["doc", frame.sub_doc],
      ["clock", ` @${frame.clock} `],
      ["type", `${type || "op"} `],
      ["body", JSON.stringify(fields)],
    ];
    for (const [cls, text] of parts) {
      const span = document.createElement("span");
      span.className = cls;
      span.textContent = text;
      li.append(span);
    }
    list.prepend(li);
    state.opsShown += 1;
    while (list.children.length > MAX_OPS_SHOWN) list.lastElementChild.remove();
    $("ops-count").textContent = String(state.opsShown);
    const row = document.querySelector(`#docs tr[data-sub-doc="${CSS.escape(frame.sub_doc)}"]`);
    if (row && Number(row.dataset.clock) < frame.clock) {
      row.dataset.clock = String(frame.clock);
      row.cells[1].textContent = String(frame.clock);
      row.cells[3].textContent =
        committedAt != null ? `${formatAge(serverNow() - committedAt)} ago` : "just now";
    }
  }

  // -- queue ------------------------------------------------------------------------------------

  async function refreshQueue() {
    const ws = encodeURIComponent(state.workspace);
    const pages = await Promise.all(
      LIVE_STATUSES.map((status) =>
        api(`/v1/queue/requests?workspace=${ws}&status=${status}&limit=100`),
      ),
    );
    const live = new Map();
    const counts = {};
    LIVE_STATUSES.forEach((status, i) => {
      const page = pages[i];
      counts[status] = `${page.requests.length}${page.next_after ? "+" : ""}`;
      for (const row of page.requests) live.set(row.request_id, row);
    });
    // A request that left the live listings finished (or was cancelled) while we watched: read
    // it once for its final status.
    // At most as many as are shown: a burst of completions costs a bounded number of reads.
    const gone = [...state.requests.keys()]
      .filter((id) => !live.has(id))
      .slice(-MAX_FINISHED_SHOWN);
    const finished = await Promise.all(
      gone.map((id) =>
        api(`${wsPath()}/requests/${encodeURIComponent(id)}`).catch(() => null),
      ),
    );
    for (const row of finished) {
      if (row && !live.has(row.request_id)) state.finished.set(row.request_id, row);
    }
    for (const id of live.keys()) state.finished.delete(id);
    while (state.finished.size > MAX_FINISHED_SHOWN) {
      state.finished.delete(state.finished.keys().next().value);
    }
    state.requests = live;
    renderCounts(counts);
    renderQueue();
  }

  function renderCounts(counts) {
    const box = $("queue-counts");
    const items = Object.entries(counts).map(([status, count]) => {
      const span = document.createElement("span");
      span.dataset.status = status;
      const b = document.createElement("b");
      b.textContent = count;
      span.append(`${status.replace("_", " ")} `, b);
      return span;
    });
    box.replaceChildren(...items);
  }

  function renderQueue() {
    const now = serverNow();
    const order = { poison: 0, in_progress: 1, pending: 2 };
    const live = [...state.requests.values()].sort(
      (a, b) => (order[a.status] ?? 3) - (order[b.status] ?? 3) || a.created_at - b.created_at,
    );
    const finished = [...state.finished.values()].reverse();
    const rows = [...live, ...finished].map((row) => {
      const tr = document.createElement("tr");
      tr.dataset.requestId = row.request_id;
      tr.dataset.status = row.status;
      const attempts = `${row.dequeue_count}/${row.max_dequeues}`;
      const status = row.cancel_requested ? `${row.status} (cancel requested)` : row.status;
      cells(tr, [
        row.request_id,
        row.stage,
        status.replace("_", " "),
        row.claimed_by || "",
        formatAge(now - row.created_at),
        attempts,
        errorText(row.error),
      ]);
      tr.cells[2].className = "status";
      tr.cells[6].className = "error";
      const actions = document.createElement("td");
      if (row.status === "poison") {
        actions.append(...actionButtons("replay", row), ...actionButtons("discard", row));
      }
      // In progress, a cancel is a request the holder acts on at its next heartbeat: once asked,
      // asking again changes nothing.
      const cancellable = row.status === "pending" || row.status === "in_progress";
      if (cancellable && !row.cancel_requested) actions.append(...actionButtons("cancel", row));
      tr.append(actions);
      return tr;
    });
    $("queue").tBodies[0].replaceChildren(...rows);
  }

  /** Whether `row`'s `action` button is asking for confirmation now. */
  function asking(action, row) {
    const c = state.confirming;
    return !!c && c.action === action && c.requestId === row.request_id && c.until > Date.now();
  }

  function askFirst(action, row) {
    state.confirming = { action, requestId: row.request_id, until: Date.now() + CONFIRM_S * 1000 };
    renderQueue();
    const generation = state.generation;
    setTimeout(() => generation === state.generation && renderQueue(), CONFIRM_S * 1000 + 50);
  }

  function stopAsking() {
    state.confirming = null;
    renderQueue();
  }

  /** A row's replay, discard or cancel: the first click asks ("Confirm cancel?", with "keep" beside it),
   * the second acts. The question is kept in `state.confirming`, not in the button, so it
   * survives the table being redrawn on each refresh, until it is answered or lapses. */
  function actionButtons(action, row) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = action;
    if (!asking(action, row)) {
      button.textContent = action;
      button.addEventListener("click", () => askFirst(action, row));
      return [button];
    }
    button.textContent = `Confirm ${action}?`;
    button.dataset.confirm = "true";
    const keep = document.createElement("button");
    keep.type = "button";
    keep.className = "keep";
    keep.textContent = "keep";
    keep.addEventListener("click", stopAsking);
    button.addEventListener("click", async () => {
      state.confirming = null;
      button.disabled = true;
      keep.disabled = true;
      try {
        const answer = await api(
          `${wsPath()}/requests/${encodeURIComponent(row.request_id)}/${action}`,
          { method: "POST" },
        );
        if (action === "discard") {
          // The row is deleted: no later read finds it, so it is shown here, as discarded.
          state.requests.delete(row.request_id);
          state.finished.set(row.request_id, { ...answer, status: "discarded" });
        }
        showError("");
      } catch (error) {
        if (error instanceof StaleAnswer) return;
        showError(`${action} ${row.request_id}: ${error.message}`);
      }
      await refreshQueue().catch(reportError);
    });
    return [button, keep];
  }

  // -- compute locks ----------------------------------------------------------------------------

  async function refreshLocks() {
    const page = await api(`${wsPath()}/locks?limit=${PAGE}`);
    state.locks = page.locks;
    state.locksFetchedAt = Date.now() / 1000;
    $("locks-count").textContent = page.next_after ? `${PAGE}+` : String(page.locks.length);
    renderLocks();
  }

  function renderLocks() {
    const elapsed = Date.now() / 1000 - state.locksFetchedAt;
    const rows = state.locks
      .filter((lock) => lock.expires_in - elapsed > 0)
      .map((lock) => {
        const tr = document.createElement("tr");
        tr.dataset.lock = `${lock.job_id}/${lock.task}`;
        cells(tr, [lock.job_id, lock.task, lock.holder, formatAge(lock.expires_in - elapsed)]);
        return tr;
      });
    $("locks").tBodies[0].replaceChildren(...rows);
  }

  // -- schedules (docs/queue.md, "Schedules") ---------------------------------------------------

  async function refreshSchedules() {
    const page = await api(`${wsPath()}/schedules?limit=${PAGE}`);
    state.schedules = page.schedules;
    state.schedulesFetchedAt = Date.now() / 1000;
    $("schedules-count").textContent = page.next_after ? `${PAGE}+` : String(page.schedules.length);
    renderSchedules();
  }

  /** When a schedule fires next, from the page's clock: "in 42s", "due", or "paused". */
  function nextFiringText(schedule) {
    if (schedule.paused || schedule.next_fire_at === null) return "paused";
    const left = schedule.next_fire_at - Date.now() / 1000;
    return left > 0 ? `in ${formatAge(left)}` : "due";
  }

  function renderSchedules() {
    const rows = state.schedules.map((schedule) => {
      const tr = document.createElement("tr");
      tr.dataset.schedule = schedule.name;
      const when = schedule.cron !== null ? schedule.cron : `every ${schedule.interval_seconds}s`;
      const last =
        schedule.last_fired_at === null ? "never" : `${formatAge(Date.now() / 1000 - schedule.last_fired_at)} ago`;
      cells(tr, [
        schedule.name,
        when,
        nextFiringText(schedule),
        last,
        schedule.last_request_id || "",
        String(schedule.skipped),
      ]);
      return tr;
    });
    $("schedules").tBodies[0].replaceChildren(...rows);
  }

  // -- charts (hand-drawn SVG) ------------------------------------------------------------------

  async function refreshMetrics() {
    let text;
    try {
      text = await api("/metrics", { raw: true });
    } catch (error) {
      if (error instanceof StaleAnswer) throw error;
      // Optional for the page: the listings work without them.
      const why = `metrics unavailable (${error.status || error.message})`;
      $("value-queue-wait").textContent = why;
      $("value-stage-wall").textContent = why;
      return;
    }
    const samples = parsePrometheus(text);
    const waits = histogramTotals(samples, "cv_queue_wait_seconds", null);
    const stages = histogramTotals(samples, "cv_stage_seconds", "stage");
    const history = state.metricsHistory;
    history.push({ waits, stages });
    while (history.length > MEAN_WINDOW + 1) history.shift();
    if (!waits.size) $("value-queue-wait").textContent = "not exported by this server";
    if (!stages.size) $("value-stage-wall").textContent = "not exported by this server";
    if (history.length < 2) return;
    const last = history[0];
    const wait = intervalMean(last.waits.get("all"), waits.get("all"));
    pushPoint(state.charts.queueWait, "wait", wait);
    if (waits.size) $("value-queue-wait").textContent = wait == null ? "idle" : `${formatNumber(wait)} s`;
    const latest = [];
    for (const [stage, totals] of stages) {
      const mean = intervalMean(last.stages.get(stage), totals);
      pushPoint(state.charts.stageWall, stage, mean);
      if (mean != null) latest.push(`${stage} ${formatNumber(mean)} s`);
    }
    if (stages.size) $("value-stage-wall").textContent = latest.join(" · ") || "idle";
  }

  function pushPoint(chart, name, value) {
    const series = chart.series.get(name) || [];
    series.push(value);
    while (series.length > CHART_POINTS) series.shift();
    chart.series.set(name, series);
  }

  function drawChart(svg, chart) {
    const W = 300;
    const H = 90;
    const PAD = 14;
    const ns = "http://www.w3.org/2000/svg";
    const values = [...chart.series.values()].flat().filter((v) => v != null);
    const max = niceCeil(Math.max(0, ...values));
    const children = [];
    for (const fraction of [0, 0.5, 1]) {
      const y = H - PAD - fraction * (H - 2 * PAD);
      const grid = document.createElementNS(ns, "line");
      grid.setAttribute("x1", "0");
      grid.setAttribute("x2", String(W));
      grid.setAttribute("y1", String(y));
      grid.setAttribute("y2", String(y));
      grid.setAttribute("stroke", "#e6e9ef");
      children.push(grid);
      const label = document.createElementNS(ns, "text");
      label.setAttribute("x", "2");
      label.setAttribute("y", String(y - 2));
      label.setAttribute("font-size", "8");
      label.setAttribute("fill", "#6b7385");
      label.textContent = values.length ? String(Number((max * fraction).toPrecision(3))) : "";
      children.push(label);
    }
    let color = 0;
    for (const [name, series] of chart.series) {
      const stroke = COLORS[color++ % COLORS.length];
      // A gap (null: nothing observed in that interval) breaks the line.
      let points = [];
      const flush = () => {
        if (points.length) {
          const line = document.createElementNS(ns, "polyline");
          line.setAttribute("points", points.join(" "));
          line.setAttribute("fill", "none");
          line.setAttribute("stroke", stroke);
          line.setAttribute("stroke-width", "1.5");
          children.push(line);
          if (points.length === 1) {
            const [x, y] = points[0].split(",");
            const dot = document.createElementNS(ns, "circle");
            dot.setAttribute("cx", x);
            dot.setAttribute("cy", y);
            dot.setAttribute("r", "1.8");
            dot.setAttribute("fill", stroke);
            children.push(dot);
          }
        }
        points = [];
      };
      series.forEach((value, i) => {
        if (value == null) return flush();
        const x = W - (series.length - 1 - i) * (W / (CHART_POINTS - 1));
        const y = H - PAD - (value / max) * (H - 2 * PAD);
        points.push(`${x.toFixed(1)},${y.toFixed(1)}`);
      });
      flush();
      if (chart.series.size > 1) {
        const legend = document.createElementNS(ns, "text");
        legend.setAttribute("x", String(W - 4));
        legend.setAttribute("y", String(10 + 9 * (color - 1)));
        legend.setAttribute("text-anchor", "end");
        legend.setAttribute("font-size", "8");
        legend.setAttribute("fill", stroke);
        legend.textContent = name;
        children.push(legend);
      }
    }
    svg.replaceChildren(...children);
  }

  function drawCharts() {
    drawChart($("chart-commit-rate"), state.charts.commitRate);
    drawChart($("chart-queue-wait"), state.charts.queueWait);
    drawChart($("chart-stage-wall"), state.charts.stageWall);
  }

  // -- wiring -----------------------------------------------------------------------------------

  function cells(tr, texts) {
    for (const text of texts) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.append(td);
    }
  }

  function reportError(error) {
    if (error instanceof StaleAnswer) return;
    if (error instanceof ProblemError && (error.status === 401 || error.status === 403)) {
      setStatus("error", error.status === 401 ? "token refused" : "workspace not granted");
    }
    showError(error.message || String(error));
  }

  async function refreshAll(generation) {
    if (generation !== state.generation) return;
    try {
      if (can("read")) await refreshDocs();
      await Promise.all([
        can("operate") ? refreshQueue() : null,
        can("operate") ? refreshLocks() : null,
        can("enqueue") || can("operate") ? refreshSchedules() : null,
        refreshMetrics(),
      ]);
      drawCharts();
      // Without `read` there is no live stream to say so: a refresh that went through does.
      if ($("status").dataset.state === "error" || !can("read")) setStatus("live", "live");
      document.body.dataset.loaded = "true";
      state.refreshes += 1;
    } catch (error) {
      reportError(error);
    }
    if (generation === state.generation) {
      setTimeout(() => refreshAll(generation), state.refreshS * 1000);
    }
  }

  function connect() {
    state.token = $("token").value.trim();
    state.workspace = $("workspace").value.trim();
    if (!state.workspace) {
      state.workspace = decodeTokenWorkspaces(state.token).find((w) => w !== "*") || "";
      $("workspace").value = state.workspace;
    }
    if (!state.token || !state.workspace) {
      setStatus("error", "enter a token and a workspace");
      return;
    }
    sessionStorage.setItem("cv-dashboard-token", state.token);
    history.replaceState(null, "", `${location.pathname}#ws=${encodeURIComponent(state.workspace)}`);
    state.generation += 1;
    if (state.socket) state.socket.close(1000);
    state.subscribed = new Map();
    state.synced = new Set();
    state.confirming = null;
    state.refreshes = 0;
    state.requests = new Map();
    state.finished = new Map();
    state.firstDocsLoaded = false;
    state.lastClockSum = null;
    state.metricsHistory = [];
    for (const chart of Object.values(state.charts)) chart.series = new Map();
    $("ops").replaceChildren();
    state.opsShown = 0;
    showError("");
    state.scopes = decodeTokenScopes(state.token);
    renderAllowed();
    $("queue-counts").replaceChildren();
    $("queue").tBodies[0].replaceChildren();
    $("docs").tBodies[0].replaceChildren();
    state.locks = [];
    renderLocks();
    state.schedules = [];
    renderSchedules();
    setStatus("connecting", "connecting");
    const generation = state.generation;
    if (can("read")) openSocket(generation);
    refreshAll(generation);
  }

  /** Read the fragment (`#token=&ws=&refresh=`), taking the token out of the address bar (and
   * so out of screenshots and shared links) at once. Returns what it named. */
  function takeFragment() {
    const fragment = new URLSearchParams(location.hash.slice(1));
    const refresh = Number(fragment.get("refresh"));
    if (Number.isFinite(refresh) && refresh > 0) state.refreshS = refresh;
    if (fragment.has("token")) history.replaceState(null, "", location.pathname);
    return { token: fragment.get("token"), workspace: fragment.get("ws") };
  }

  /** A link pasted into an open tab changes only the fragment: the page does not load again, so
   * it is taken as a load takes it. A new token with no `ws` means the token's own workspace;
   * a fragment naming what is shown already (the page's own `#ws=`) changes nothing. */
  function onHashChange() {
    const { token, workspace } = takeFragment();
    if (token == null && workspace == null) return;
    if (token != null) {
      $("token").value = token;
      $("workspace").value = workspace || "";
    } else {
      $("workspace").value = workspace;
    }
    const same =
      $("token").value.trim() === state.token && $("workspace").value.trim() === state.workspace;
    if (!same || !state.token) connect();
  }

  function start() {
    const { token: fromFragment, workspace } = takeFragment();
    const token = fromFragment || sessionStorage.getItem("cv-dashboard-token") || "";
    $("token").value = token;
    $("workspace").value = workspace || "";
    $("connect").addEventListener("submit", (event) => {
      event.preventDefault();
      connect();
    });
    window.addEventListener("hashchange", onHashChange);
    setInterval(renderLocks, 1000); // time left counts down between refreshes
    if (token) connect();
  }

  window.cvDashboard = {
    parsePrometheus,
    histogramTotals,
    intervalMean,
    niceCeil,
    formatAge,
    refreshes: () => state.refreshes,
  };
  start();
})();
