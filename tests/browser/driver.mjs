// A small remote control for headless Chromium, for the Python browser tests (conftest.py).
//
// It drives the system's chromium (its path in CV_CHROMIUM) through playwright-core, which never
// downloads a browser of its own, in a fresh profile (CV_USER_DATA_DIR). Commands come on stdin,
// one JSON object per line: {"id", "cmd", ...args}; each gets one line on stdout: {"id", "ok":
// true, "value"} or {"id", "ok": false, "error"}. Every wait is Playwright's own: it watches the
// page (the DOM, or a predicate evaluated each animation frame) until the condition holds or the
// command's `timeout` (ms) passes; nothing here sleeps.
import { createInterface } from "node:readline";
import { chromium } from "playwright-core";

const executablePath = process.env.CV_CHROMIUM;
const userDataDir = process.env.CV_USER_DATA_DIR;
if (!executablePath || !userDataDir) {
  process.stderr.write("CV_CHROMIUM and CV_USER_DATA_DIR must be set\n");
  process.exit(2);
}

const context = await chromium.launchPersistentContext(userDataDir, {
  executablePath,
  headless: true,
  viewport: { width: 1280, height: 900 },
  args: [
    "--no-sandbox",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-sync",
    "--no-first-run",
  ],
});
const page = context.pages()[0] || (await context.newPage());
const problems = []; // uncaught errors and console errors of the page
page.on("pageerror", (error) => problems.push(`pageerror: ${error.message}`));
page.on("console", (message) => {
  if (message.type() === "error") problems.push(`console: ${message.text()}`);
});

// A function from its source, made here in node: Playwright then sends it to the page through the
// DevTools protocol, which the page's Content-Security-Policy does not govern (a string it would
// evaluate with eval() in the page, which that policy refuses, as it should).
const fn = (source) => new Function(`return (${source});`)();

const commands = {
  goto: ({ url }) => page.goto(url, { waitUntil: "load" }).then(() => null),
  wait: ({ selector, state = "visible", timeout }) =>
    page.locator(selector).first().waitFor({ state, timeout }).then(() => null),
  waitFunction: ({ source, arg = null, timeout }) =>
    page.waitForFunction(fn(source), arg, { timeout, polling: "raf" }).then(() => null),
  click: ({ selector, timeout }) => page.locator(selector).first().click({ timeout }),
  fill: ({ selector, value }) => page.locator(selector).first().fill(value),
  text: ({ selector }) => page.locator(selector).first().textContent(),
  count: ({ selector }) => page.locator(selector).count(),
  evaluate: ({ source, arg = null }) => page.evaluate(fn(source), arg),
  screenshot: ({ path, fullPage = true }) => page.screenshot({ path, fullPage }).then(() => null),
  problems: () => problems.splice(0),
  close: async () => {
    await context.close();
    return null;
  },
};

const reply = (message) => process.stdout.write(`${JSON.stringify(message)}\n`);
reply({ id: 0, ok: true, value: "ready" });

const lines = createInterface({ input: process.stdin });
for await (const line of lines) {
  if (!line.trim()) continue;
  const { id, cmd, ...args } = JSON.parse(line);
  try {
    const run = commands[cmd];
    if (!run) throw new Error(`unknown command ${cmd}`);
    reply({ id, ok: true, value: (await run(args)) ?? null });
  } catch (error) {
    reply({ id, ok: false, error: String(error && error.message ? error.message : error) });
  }
  if (cmd === "close") break;
}
await context.close().catch(() => {});
process.exit(0);
