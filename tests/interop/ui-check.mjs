// The admin listener's operator page (`/ui`) in a real browser: Debian's headless Chromium
// driven by playwright-core (never a browser of Playwright's own). Run by tests/binary/admin_ui.rs
// against the real gateway binary, which has made the sessions this reads.
//
//   node ui-check.mjs '<json>'   {chromium, open, guarded, token, hostile, out}
//
// `open`: an admin listener without a token (loopback); `guarded`: one with
// --admin-token-file (`token`) and --admin-token-for-reads true. `hostile`: the markup a
// client sent as its protocol version. `out`: where the screenshots go.
//
// Every check compares what the browser shows (the DOM after Chromium parsed and laid out the
// page) with the JSON the same listener answers (GET /sessions, /sessions/{id}). The pages are
// read with JavaScript disabled (they must need no script); the hostile markup is also checked
// with JavaScript enabled, where an unescaped `onerror` would run. Prints `RESULT {json}` and
// exits 0 when every check passed; otherwise prints `FAILED <why>` and exits 1.

import { chromium } from 'playwright-core';
import { join } from 'node:path';
import { statSync } from 'node:fs';

const cfg = JSON.parse(process.argv[2]);
const TIMEOUT_MS = 10_000;
// What Chromium needs on these machines: no sandbox (root), no GPU, and none of its own
// network traffic (a closed network refuses it). Playwright gives it a new empty profile.
const FLAGS = [
  '--no-sandbox',
  '--disable-gpu',
  '--disable-quic',
  '--no-first-run',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
];

const passed = [];
function check(ok, what, detail) {
  if (!ok) throw new Error(`${what}${detail === undefined ? '' : `: ${detail}`}`);
  passed.push(what);
}
function eq(got, want, what) {
  const [g, w] = [JSON.stringify(got), JSON.stringify(want)];
  check(g === w, what, `the browser shows ${g}, want ${w}`);
}

/// GET `path` of an admin listener as JSON (Node's own fetch: not the browser).
async function json(base, path, token) {
  const headers = token ? { authorization: `Bearer ${token}` } : {};
  const r = await fetch(base + path, { headers });
  if (r.status !== 200) throw new Error(`GET ${path}: ${r.status} ${await r.text()}`);
  return r.json();
}

/// A Unix ms time as the page writes it: UTC `YYYY-MM-DD HH:MM:SS`.
const utc = (ms) => new Date(Math.floor(ms / 1000) * 1000).toISOString().slice(0, 19).replace('T', ' ');

/// What the list page's row of session `s` should say, column by column.
function listRow(s) {
  return [
    s.id,
    s.principal,
    s.shape,
    s.protocol_version ?? '-',
    utc(s.created_ms),
    utc(s.last_used_ms),
    String(s.streams.length),
    String(s.streams.filter((x) => x.state !== 'ended').length),
    String(s.attached_clients),
    windowText(s.window_events, s.window_bytes),
    s.replicas.join(', '),
  ];
}

/// What a window holds, as the pages say it: `1 event, 312 B`, `3 events, 900 B`.
function windowText(events, bytes) {
  return `${events} event${events === 1 ? '' : 's'}, ${bytes} B`;
}

/// What the session page's facts table should say (`#session`: header → value).
function facts(listing, s) {
  return {
    principal: s.principal,
    shape: s.shape,
    'protocol version': s.protocol_version ?? '-',
    endpoint: s.endpoint,
    created: utc(s.created_ms),
    'last used': utc(s.last_used_ms),
    'attached clients': String(s.attached_clients),
    window: windowText(s.window_events, s.window_bytes),
    replicas: s.replicas.join(', '),
    'seen by': `this gateway: ${listing.replicas.join(', ')}`,
  };
}

/// What the session page's `#streams` rows should say.
function streamRows(s) {
  return s.streams.map((x) => [
    String(x.number),
    x.kind,
    x.state,
    x.attached ? 'attached' : '-',
    `${x.first_seq}\u2013${x.last_seq}`,
    windowText(x.window_events, x.window_bytes),
    String(x.pending_requests),
    x.replica,
  ]);
}

/// A table as the browser parsed it: header cells and each body row's cells (text content).
function readTable(page, selector) {
  return page.evaluate((sel) => {
    const t = document.querySelector(sel);
    if (!t) return null;
    const text = (c) => c.textContent;
    return {
      head: t.tHead ? [...t.tHead.rows[0].cells].map(text) : [],
      rows: t.tBodies.length ? [...t.tBodies[0].rows].map((r) => [...r.cells].map(text)) : [],
      // Each row's header cell, for the facts table (`<th>name</th><td>value</td>`).
      pairs: t.tBodies.length
        ? [...t.tBodies[0].rows].map((r) => [r.querySelector('th')?.textContent, r.querySelector('td')?.textContent])
        : [],
    };
  }, selector);
}

/// What a page holds that could run: scripts, inline handlers, and the elements a hostile
/// value would have made had it not been escaped.
function active(page) {
  return page.evaluate(() => ({
    scripts: document.querySelectorAll('script').length,
    handlers: [...document.querySelectorAll('*')].filter((e) => [...e.attributes].some((a) => a.name.startsWith('on')))
      .length,
    img: document.querySelectorAll('img').length,
    b: document.querySelectorAll('b').length,
    iframes: document.querySelectorAll('iframe, object, embed').length,
  }));
}

/// Loads `url` and checks its status; the table named `selector`, if any, is laid out with
/// a size (it is on screen, not only in the markup).
async function load(page, url, status, what) {
  const r = await page.goto(url, { waitUntil: 'load' });
  eq(r.status(), status, `${what}: status`);
  return r;
}

async function visible(page, selector, what) {
  const box = await page.locator(selector).boundingBox();
  check(box && box.width > 0 && box.height > 0, `${what}: ${selector} laid out with a size`, JSON.stringify(box));
  check(await page.locator(selector).isVisible(), `${what}: ${selector} visible`);
  return box;
}

/// Compares the list page with GET /sessions; retried (page and JSON again) when a time moved
/// between the two reads.
async function listMatches(page, base, token, what) {
  for (let attempt = 1; ; attempt++) {
    const r = await load(page, `${base}/ui`, 200, what);
    eq(r.headers()['content-type'], 'text/html; charset=utf-8', `${what}: served as HTML`);
    const listing = await json(base, '/sessions', token);
    const table = await readTable(page, '#sessions');
    check(table !== null, `${what}: the page has #sessions`);
    const want = listing.sessions.map(listRow);
    if (JSON.stringify(table.rows) !== JSON.stringify(want) && attempt < 3) continue;
    eq(table.rows.length, listing.sessions.length, `${what}: one row per session of GET /sessions`);
    eq(table.rows.map((r) => r[0]), listing.sessions.map((s) => s.id), `${what}: each row's id is the JSON's`);
    eq(table.rows, want, `${what}: every cell as GET /sessions says`);
    eq(
      table.head,
      ['id', 'principal', 'shape', 'protocol', 'created', 'last used', 'streams', 'running', 'clients', 'window', 'replicas'],
      `${what}: the columns`,
    );
    const hrefs = await page.locator('#sessions tbody tr td:first-child a').evaluateAll((as) => as.map((a) => a.getAttribute('href')));
    eq(hrefs, listing.sessions.map((s) => `/ui/sessions/${s.id}`), `${what}: each id links to its page`);
    const n = listing.sessions.length;
    eq(
      (await page.locator('#summary').textContent()).trim(),
      `${n} session${n === 1 ? '' : 's'} held by this gateway: ${listing.replicas.join(', ')}.`,
      `${what}: the summary line`,
    );
    return listing;
  }
}

/// Compares the session page on screen with GET /sessions/{id}.
async function sessionMatches(page, base, token, id, what) {
  for (let attempt = 1; ; attempt++) {
    const one = await json(base, `/sessions/${id}`, token);
    const s = one.sessions[0];
    const f = await readTable(page, '#session');
    const st = await readTable(page, '#streams');
    const same =
      JSON.stringify(Object.fromEntries(f?.pairs ?? [])) === JSON.stringify(facts(one, s)) &&
      JSON.stringify(st?.rows ?? []) === JSON.stringify(streamRows(s));
    if (!same && attempt < 3) {
      await page.reload({ waitUntil: 'load' });
      continue;
    }
    check(f !== null, `${what}: the page has #session`);
    eq(Object.fromEntries(f.pairs), facts(one, s), `${what}: the facts as GET /sessions/{id} says`);
    if (s.streams.length) {
      check(st !== null, `${what}: the page has #streams`);
      eq(st.rows, streamRows(s), `${what}: the streams (numbers, kinds, states, positions) as GET /sessions/{id} says`);
      eq(
        st.head,
        ['stream', 'kind', 'state', 'client', 'positions', 'in window', 'pending requests', 'replica'],
        `${what}: the stream columns`,
      );
    } else {
      eq(await page.locator('#no-streams').count(), 1, `${what}: "No streams."`);
    }
    eq((await page.locator('h1').textContent()).trim(), `Session ${id}`, `${what}: the heading names it`);
    return s;
  }
}

const result = { screenshots: [] };
const t0 = Date.now();
const browser = await chromium.launch({
  executablePath: cfg.chromium,
  headless: true,
  args: FLAGS,
  timeout: 30_000,
});
try {
  result.browser = `Chromium ${browser.version()}`;

  // 1. The list, JavaScript off.
  const off = await browser.newContext({ javaScriptEnabled: false, viewport: { width: 1400, height: 700 } });
  off.setDefaultTimeout(TIMEOUT_MS);
  const page = await off.newPage();
  // Control: in this context a page's script does not run (so what renders below needs none).
  await page.setContent('<p id="c">static</p><script>document.getElementById("c").textContent = "ran"</script>');
  eq(await page.locator('#c').textContent(), 'static', 'control: scripts do not run with JavaScript off');
  const listing = await listMatches(page, cfg.open, null, 'list (JS off)');
  const box = await visible(page, '#sessions', 'list (JS off)');
  const act = await active(page);
  eq(act.scripts, 0, 'list: no <script> element');
  eq(act.handlers, 0, 'list: no on* attribute');
  const shot1 = join(cfg.out, 'ui-list.png');
  await page.screenshot({ path: shot1, fullPage: true });
  result.screenshots.push(shot1);
  result.rows = listing.sessions.length;
  result.ids = listing.sessions.map((s) => s.id);
  result.table_px = [Math.round(box.width), Math.round(box.height)];

  // 2. A click on the session with a stream running, then back.
  const busy = listing.sessions.find((s) => s.streams.some((x) => x.state === 'running'));
  check(busy !== undefined, 'a session with a running stream is listed');
  await page.locator(`#sessions a[href="/ui/sessions/${busy.id}"]`).click();
  await page.waitForURL(`**/ui/sessions/${busy.id}`);
  const s = await sessionMatches(page, cfg.open, null, busy.id, 'session page (JS off)');
  await visible(page, '#streams', 'session page (JS off)');
  eq((await active(page)).scripts, 0, 'session page: no <script> element');
  const shot2 = join(cfg.out, 'ui-session.png');
  await page.screenshot({ path: shot2, fullPage: true });
  result.screenshots.push(shot2);
  result.clicked = {
    id: busy.id,
    streams: s.streams.map((x) => `${x.number}:${x.kind}:${x.state}${x.attached ? ':attached' : ''}`),
    window: windowText(s.window_events, s.window_bytes),
  };
  await page.getByRole('link', { name: 'All sessions' }).click();
  await page.waitForURL((u) => u.pathname === '/ui');
  eq(await page.locator('#sessions tbody tr').count(), listing.sessions.length, '"All sessions" leads back to the list');
  // The other sessions' pages, as their JSON says (one without a running stream among them).
  for (const other of listing.sessions.filter((x) => x.id !== busy.id)) {
    await load(page, `${cfg.open}/ui/sessions/${other.id}`, 200, `session ${other.id}`);
    await sessionMatches(page, cfg.open, null, other.id, `session page ${other.id} (JS off)`);
  }

  // 3. What a client sent, as text: with JavaScript on, where unescaped markup would run.
  // Since issue 56 (R5-2) a protocol version that is not 1-32 bytes of [A-Za-z0-9._-] is
  // never kept: the hostile one must not reach the list at all. The control below still
  // shows the markup would run if it did; the escaping itself is src/admin/ui.rs's unit test.
  const hostile = listing.sessions.find((x) => x.protocol_version === cfg.hostile);
  check(hostile === undefined, 'GET /sessions does not carry the hostile protocol version');
  const on = await browser.newContext({ javaScriptEnabled: true });
  on.setDefaultTimeout(TIMEOUT_MS);
  const jsPage = await on.newPage();
  const dialogs = [];
  jsPage.on('dialog', (d) => {
    dialogs.push(d.message());
    d.dismiss().catch(() => {});
  });
  // Control: the same markup unescaped does run here (so no dialog below means escaped).
  await jsPage.setContent(cfg.hostile);
  for (let i = 0; i < 50 && dialogs.length === 0; i++) await jsPage.waitForTimeout(100);
  eq(dialogs.length, 1, 'control: the hostile markup, unescaped, runs its onerror with JavaScript on');
  await load(jsPage, `${cfg.open}/ui`, 200, 'list (JS on)');
  await jsPage.waitForTimeout(300);
  const listActive = await active(jsPage);
  eq([listActive.img, listActive.b, listActive.scripts, listActive.handlers, listActive.iframes], [0, 0, 0, 0, 0], 'list: no element made of what a client sent');
  eq(dialogs.length, 1, 'no script of the hostile value ran');
  result.hostile = { kept: hostile !== undefined, img: listActive.img, b: listActive.b, dialogs: dialogs.length - 1 };

  // 5. An unknown id and a bad one, JavaScript off.
  const errors = {};
  for (const [path, status, h1, message] of [
    ['/ui/sessions/0123456789abcdef', 404, 'Not found', 'no replica holds a session of that id'],
    ['/ui/sessions/not-a-session', 400, 'Not a session id', 'a session is named by its id as the list shows it: 16 hex digits'],
    ['/ui/nowhere', 404, 'Not found', 'no such page'],
  ]) {
    const r = await load(page, cfg.open + path, status, path);
    check(r.headers()['content-type'].startsWith('text/html'), `${path}: an HTML page`);
    eq((await page.locator('h1').textContent()).trim(), h1, `${path}: its heading`);
    eq((await page.locator('#message').textContent()).trim(), message, `${path}: its message`);
    await visible(page, '#message', path);
    eq(await page.getByRole('link', { name: 'All sessions' }).getAttribute('href'), '/ui', `${path}: links to the list`);
    errors[path] = status;
  }
  result.errors = errors;

  // 4. A listener whose reads need the token: a Basic challenge, then the page.
  const guarded = {};
  const bare = await browser.newContext({ javaScriptEnabled: false });
  bare.setDefaultTimeout(TIMEOUT_MS);
  const barePage = await bare.newPage();
  // Headless Chromium has no password prompt to show: the navigation fails
  // (ERR_INVALID_AUTH_CREDENTIALS), after the browser received the 401 and its challenge.
  const answer = barePage.waitForResponse(`${cfg.guarded}/ui`);
  const bareNav = await barePage
    .goto(`${cfg.guarded}/ui`)
    .then((r) => `status ${r.status()}`, (e) => e.message.match(/net::ERR_[A-Z_]+/)?.[0] ?? e.message);
  const r401 = await answer;
  eq(r401.status(), 401, 'guarded, no credentials: status');
  const challenge = r401.headers()['www-authenticate'] ?? '';
  check(/^Basic realm="[^"]+"/.test(challenge), 'guarded, no credentials: a Basic challenge', challenge);
  eq(await barePage.locator('#sessions').count(), 0, 'guarded, no credentials: no table');
  guarded.without = [r401.status(), challenge, bareNav];
  const wrong = await browser.newContext({
    javaScriptEnabled: false,
    httpCredentials: { username: 'operator', password: `${cfg.token}-not` },
  });
  wrong.setDefaultTimeout(TIMEOUT_MS);
  // Chromium gives up when the server challenges its answer again: the navigation fails
  // (a 401 Chromium keeps to itself), and the same Basic header from Node is answered 401.
  const refusedNav = await wrong
    .newPage()
    .then((p) => p.goto(`${cfg.guarded}/ui`))
    .then((r) => `status ${r.status()}`, (e) => e.message.match(/net::ERR_[A-Z_]+/)?.[0] ?? e.message);
  check(
    refusedNav === 'status 401' || refusedNav === 'net::ERR_INVALID_AUTH_CREDENTIALS',
    'guarded, a wrong password: refused in the browser',
    refusedNav,
  );
  const basicWrong = Buffer.from(`operator:${cfg.token}-not`).toString('base64');
  const wrongStatus = (await fetch(`${cfg.guarded}/ui`, { headers: { authorization: `Basic ${basicWrong}` } })).status;
  eq(wrongStatus, 401, 'guarded, a wrong Basic password: 401');
  guarded.wrong = [wrongStatus, refusedNav];
  const authed = await browser.newContext({
    javaScriptEnabled: false,
    httpCredentials: { username: 'anyone', password: cfg.token },
    viewport: { width: 1400, height: 500 },
  });
  authed.setDefaultTimeout(TIMEOUT_MS);
  const authedPage = await authed.newPage();
  const gl = await listMatches(authedPage, cfg.guarded, cfg.token, 'guarded, the token as the Basic password');
  await visible(authedPage, '#sessions', 'guarded list');
  const shot3 = join(cfg.out, 'ui-guarded.png');
  await authedPage.screenshot({ path: shot3, fullPage: true });
  result.screenshots.push(shot3);
  await authedPage.locator('#sessions tbody a').first().click();
  await authedPage.waitForURL(`**/ui/sessions/${gl.sessions[0].id}`);
  await sessionMatches(authedPage, cfg.guarded, cfg.token, gl.sessions[0].id, 'guarded session page');
  guarded.with = [200, gl.sessions.length];
  result.guarded = guarded;

  for (const p of result.screenshots) check(statSync(p).size > 2_000, `screenshot ${p} holds a picture`);
  result.checks = passed.length;
  result.ms = Date.now() - t0;
  console.log(`RESULT ${JSON.stringify(result)}`);
} catch (e) {
  console.log(`FAILED ${e.message}`);
  console.error(e.stack);
  process.exitCode = 1;
} finally {
  await browser.close();
}
