// The graphile-worker side of `bench.pg_queue` and `bench.latency`, run by Node with NODE_PATH at a
// throwaway npm prefix where graphile-worker is installed (never a dependency of this project).
//
//   node bench/_graphile_peer.js drain DSN SCHEMA JOBS WORKERS CONCURRENCY LOGDIR
//   node bench/_graphile_peer.js latency DSN SCHEMA IDLE_JOBS GAP_S LOAD_JOBS RATE CONCURRENCY LOGDIR
//
// graphile-worker keeps its tables in a schema of its own: SCHEMA + "_gw" (created by its
// migrations, dropped at the end). drain: JOBS no-op jobs added in batches (`addJobs`, one call
// per batch), then WORKERS Node processes, each a `run()` with `concurrency` CONCURRENCY
// (LISTEN/NOTIFY on, as it ships), drain them; the parent polls until the jobs table is empty
// (graphile-worker deletes a job when it succeeds), then stops them. latency: one runner stays up
// while the parent adds one job per `addJob` call, idle (next job only after the previous started
// and a gap passed) then at a steady rate, as `bench._peer_common.drive_latency` does.
//
// Each job appends "index start" (start = wall-clock seconds taken first thing) to its process's
// log; a job run twice or missing fails the run. Prints one JSON line, like the Python peers.
"use strict";

const fs = require("fs");
const path = require("path");
const { fork } = require("child_process");
const { performance } = require("perf_hooks");
const { run, runMigrations, makeWorkerUtils, Logger } = require("graphile-worker");
const pg = require("pg");

const ENQUEUE_BATCH = 500;
const DRAIN_TIMEOUT_MS = 900000;
const PHASE_TIMEOUT_MS = 120000;
const LOAD_IN_FLIGHT = 16;
const quiet = new Logger(() => () => {});

const now = () => (performance.timeOrigin + performance.now()) / 1000;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function readStarts(logdir) {
  const merged = new Map();
  for (const name of fs.readdirSync(logdir).filter((n) => /^w\d+\.log$/.test(n)).sort()) {
    for (const line of fs.readFileSync(path.join(logdir, name), "utf8").split("\n")) {
      const parts = line.split(" ");
      if (parts.length !== 2 || parts[1] === "") continue;
      const index = Number(parts[0]);
      if (merged.has(index)) throw new Error(`job ${index} started twice`);
      merged.set(index, Number(parts[1]));
    }
  }
  return merged;
}

function percentile(values, q) {
  const ordered = [...values].sort((a, b) => a - b);
  return ordered[Math.max(1, Math.ceil((q / 100) * ordered.length)) - 1];
}

function summary(latencies, elapsed) {
  const ms = latencies.map((x) => 1000 * x);
  return {
    n: ms.length,
    p50_ms: percentile(ms, 50),
    p99_ms: percentile(ms, 99),
    mean_ms: ms.reduce((a, b) => a + b, 0) / ms.length,
    max_ms: Math.max(...ms),
    rate_per_s: ms.length / elapsed,
  };
}

async function child(dsn, schema, concurrency, logfile) {
  const fd = fs.openSync(logfile, "a");
  const taskList = {
    noop: async (payload) => {
      const started = now();
      fs.writeSync(fd, `${payload.i} ${started}\n`);
    },
  };
  await new Promise((resolve) => process.once("message", resolve)); // "go"
  const runner = await run({
    connectionString: dsn,
    schema,
    concurrency,
    noHandleSignals: true,
    logger: quiet,
    taskList,
  });
  process.send("running");
  await new Promise((resolve) => process.once("message", resolve)); // "stop"
  await runner.stop();
  fs.closeSync(fd);
  process.exit(0);
}

async function startChildren(dsn, schema, workers, concurrency, logdir) {
  const children = [];
  for (let k = 0; k < workers; k++) {
    const args = ["child", dsn, schema, String(concurrency), path.join(logdir, `w${k}.log`)];
    children.push(fork(__filename, args, { stdio: ["ignore", "ignore", "inherit", "ipc"] }));
  }
  return children;
}

async function go(children) {
  const running = children.map((c) => new Promise((resolve) => c.once("message", resolve)));
  for (const c of children) c.send("go");
  await Promise.all(running);
}

async function stop(children) {
  const exited = children.map((c) => new Promise((resolve) => c.once("exit", resolve)));
  for (const c of children) c.send("stop");
  const grace = new Promise((resolve) => setTimeout(resolve, 60000).unref());
  await Promise.race([Promise.all(exited), grace]);
  for (const c of children) if (c.exitCode === null) c.kill("SIGKILL");
}

async function rowsPerJob(client, schema, jobs) {
  const tables = await client.query(
    "SELECT tablename FROM pg_tables WHERE schemaname = $1 ORDER BY 1",
    [schema],
  );
  const rows = {};
  for (const { tablename } of tables.rows) {
    const n = await client.query(`SELECT count(*)::int AS n FROM "${schema}"."${tablename}"`);
    rows[tablename] = Math.round((1000 * n.rows[0].n) / jobs) / 1000;
  }
  return rows;
}

function version() {
  const main = require.resolve("graphile-worker"); // <prefix>/graphile-worker/dist/index.js
  return JSON.parse(fs.readFileSync(path.join(path.dirname(main), "..", "package.json"))).version;
}

async function drain(dsn, schema, jobs, workers, concurrency, logdir, client) {
  const utils = await makeWorkerUtils({ connectionString: dsn, schema, logger: quiet });
  let enqueueS;
  try {
    const t0 = performance.now();
    for (let first = 0; first < jobs; first += ENQUEUE_BATCH) {
      const specs = [];
      for (let i = first; i < Math.min(jobs, first + ENQUEUE_BATCH); i++) {
        specs.push({ identifier: "noop", payload: { i } });
      }
      await utils.addJobs(specs);
    }
    enqueueS = (performance.now() - t0) / 1000;
  } finally {
    await utils.release();
  }
  const children = await startChildren(dsn, schema, workers, concurrency, logdir);
  const t0 = performance.now();
  try {
    await go(children);
    const deadline = Date.now() + DRAIN_TIMEOUT_MS;
    for (;;) {
      const left = await client.query(`SELECT count(*)::int AS n FROM "${schema}"._private_jobs`);
      if (left.rows[0].n === 0) break;
      if (Date.now() > deadline || children.some((c) => c.exitCode !== null)) {
        throw new Error("the graphile-worker drain stalled");
      }
      await sleep(50);
    }
  } finally {
    await stop(children);
  }
  const wallS = (performance.now() - t0) / 1000;
  const starts = readStarts(logdir);
  for (let i = 0; i < jobs; i++) {
    if (!starts.has(i)) throw new Error(`job ${i} never ran`);
  }
  if (starts.size !== jobs) throw new Error(`${starts.size} jobs ran, ${jobs} added`);
  const times = [...starts.values()];
  return {
    system: "graphile-worker",
    version: version(),
    succeeded: starts.size,
    enqueue_s: enqueueS,
    drain_s: Math.max(...times) - Math.min(...times),
    wall_s: wallS,
    rows_per_job: await rowsPerJob(client, schema, jobs),
  };
}

async function waitStarted(logdir, indexes, deadline) {
  for (;;) {
    const seen = readStarts(logdir);
    if (indexes.every((i) => seen.has(i))) return seen;
    if (Date.now() > deadline) throw new Error("jobs never started");
    await sleep(5);
  }
}

async function latency(dsn, schema, idle, gapS, load, rate, concurrency, logdir) {
  const children = await startChildren(dsn, schema, 1, concurrency, logdir);
  const utils = await makeWorkerUtils({ connectionString: dsn, schema, logger: quiet });
  try {
    await go(children);
    for (let i = idle + load; i < idle + load + 3; i++) {
      // warm-up, unmeasured (WARMUP_JOBS in bench/_peer_common.py)
      await utils.addJob("noop", { i });
      await waitStarted(logdir, [i], Date.now() + PHASE_TIMEOUT_MS);
    }
    await sleep(1000 * gapS);
    const sent = new Map();
    let began = performance.now();
    for (let i = 0; i < idle; i++) {
      sent.set(i, now());
      await utils.addJob("noop", { i });
      await waitStarted(logdir, [i], Date.now() + PHASE_TIMEOUT_MS);
      await sleep(1000 * gapS);
    }
    const idleElapsed = (performance.now() - began) / 1000;
    const loadIdx = [];
    const calls = [];
    let inFlight = 0;
    const waiting = [];
    const one = async (i) => {
      // at most LOAD_IN_FLIGHT addJob calls at once, as bench/_peer_common.py
      while (inFlight >= LOAD_IN_FLIGHT) await new Promise((resolve) => waiting.push(resolve));
      inFlight++;
      try {
        await utils.addJob("noop", { i });
      } finally {
        inFlight--;
        if (waiting.length) waiting.shift()();
      }
    };
    began = performance.now();
    for (let k = 0; k < load; k++) {
      const i = idle + k;
      const delay = began + (1000 * k) / rate - performance.now();
      if (delay > 0) await sleep(delay);
      sent.set(i, now());
      calls.push(one(i));
      loadIdx.push(i);
    }
    await Promise.all(calls);
    const loadElapsed = (performance.now() - began) / 1000;
    const seen = await waitStarted(logdir, loadIdx, Date.now() + PHASE_TIMEOUT_MS);
    const idleLat = [];
    for (let i = 0; i < idle; i++) idleLat.push(seen.get(i) - sent.get(i));
    return {
      system: "graphile-worker",
      version: version(),
      idle: summary(idleLat, idleElapsed),
      load: summary(loadIdx.map((i) => seen.get(i) - sent.get(i)), loadElapsed),
    };
  } finally {
    await utils.release();
    await stop(children);
  }
}

async function main() {
  const [mode, dsn, base, ...rest] = process.argv.slice(2);
  if (mode === "child") {
    await child(dsn, base, Number(rest[0]), rest[1]);
    return;
  }
  const schema = `${base}_gw`;
  const client = new pg.Client({ connectionString: dsn });
  await client.connect();
  let report;
  try {
    await runMigrations({ connectionString: dsn, schema, logger: quiet });
    if (mode === "drain") {
      const [jobs, workers, concurrency, logdir] = rest;
      report = await drain(dsn, schema, +jobs, +workers, +concurrency, logdir, client);
    } else {
      const [idle, gap, load, rate, concurrency, logdir] = rest;
      report = await latency(dsn, schema, +idle, +gap, +load, +rate, +concurrency, logdir);
    }
  } finally {
    await client.query(`DROP SCHEMA IF EXISTS "${schema}" CASCADE`);
    await client.end();
  }
  process.stdout.write(JSON.stringify(report) + "\n");
}

main().catch((err) => {
  process.stderr.write(`${err.stack || err}\n`);
  process.exit(1);
});
