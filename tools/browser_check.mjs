// The step player in a real browser: JupyterLab + headless Chromium, driven by playwright-core.
//
// tools/browser_check.sh starts JupyterLab and runs this file. We:
//   1. open notebooks/06-continuous-batching.ipynb and run every cell (Run menu > Run All Cells);
//   2. wait until every code cell has run, and fail on any Python traceback;
//   3. find the first step player (.minicb-step-player) and check its slot timeline
//      (.minicb-slot-timeline) and block map (.minicb-block-map) are images that rendered;
//   4. move its step slider with the keyboard (Home: step 0) and through its readout
//      (type a step number): the pictures must change, and by the second step the
//      queues (.minicb-queues) must show a request finished (an eviction) and a
//      waiting request admitted in its place (a refill);
//   5. check the page never says "Error displaying widget" nor stays on "Loading widget".
// Screenshots go to build/screenshots/. Any failure exits non-zero with a message saying what.
//
//   node tools/browser_check.mjs --url http://127.0.0.1:PORT --token TOKEN [--out DIR] [--timeout SECONDS]

import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';

import { chromium } from 'playwright-core';

const { values: options } = parseArgs({
  options: {
    url: { type: 'string' },
    token: { type: 'string' },
    notebook: { type: 'string', default: 'notebooks/06-continuous-batching.ipynb' },
    out: { type: 'string', default: 'build/screenshots' },
    timeout: { type: 'string', default: '420' }, // seconds allowed for running the whole notebook
  },
});
if (!options.url || !options.token) {
  console.error('usage: node tools/browser_check.mjs --url http://127.0.0.1:PORT --token TOKEN');
  process.exit(2);
}
const runTimeoutMs = Number(options.timeout) * 1000;
mkdirSync(options.out, { recursive: true });
const shot = (name) => join(options.out, name);

class CheckFailed extends Error {}
const fail = (message) => { throw new CheckFailed(message); };
const log = (message) => console.log(`[browser-check] ${message}`);

const browser = await chromium.launch({
  executablePath: '/usr/bin/chromium',
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
         '--no-first-run', '--disable-sync'],
});
const page = await browser.newPage({ viewport: { width: 1500, height: 1100 } });
let exitCode = 0;

try {
  // ---- 1. start the kernel, open the notebook, run everything -----------------------------
  // The kernel is started through the server's REST API before the page opens, and
  // Lab connects to that session. Left to itself on a slow machine, Lab may start
  // a kernel, replace it, and drop a run request sent in between.
  const api = async (method, path, body) => {
    const response = await fetch(`${options.url}${path}`, {
      method, body: body && JSON.stringify(body),
      headers: { Authorization: `token ${options.token}`, 'Content-Type': 'application/json' },
    });
    if (!response.ok) fail(`${method} ${path} answered HTTP ${response.status}: ${await response.text()}`);
    return response.json();
  };
  const session = await api('POST', '/api/sessions', {
    path: options.notebook, name: options.notebook.split('/').pop(), type: 'notebook', kernel: { name: 'python3' },
  });
  const kernelState = async () => (await api('GET', `/api/kernels/${session.kernel.id}`)).execution_state;
  log(`started kernel ${session.kernel.id}; opening ${options.notebook}`);
  await page.goto(`${options.url}/lab/tree/${options.notebook}?token=${options.token}`,
                  { waitUntil: 'domcontentloaded', timeout: 120_000 });
  await page.locator('.jp-NotebookPanel .jp-CodeCell').first()
    .waitFor({ timeout: 120_000 })
    .catch(() => fail(`the notebook ${options.notebook} did not open in JupyterLab within 120 s`));
  // The kernel answers Lab's first requests only once it is up: wait for Idle on both sides.
  await page.getByText(/\| Idle$/).first().waitFor({ timeout: 120_000 })
    .catch(() => fail('JupyterLab did not show its kernel as Idle within 120 s of opening the notebook'));
  for (const began = Date.now(); (await kernelState()) !== 'idle';) {
    if (Date.now() - began > 60_000) fail(`the kernel is still ${await kernelState()} 60 s after Lab showed Idle`);
    await page.waitForTimeout(500);
  }

  // A prompt reads "[ ]:" before a cell runs, "[*]:" while it runs or waits, "[7]:" after.
  // textContent, not innerText: the browser may skip laying out cells off screen.
  const prompts = () => page.locator('.jp-NotebookPanel .jp-CodeCell .jp-InputPrompt').allTextContents();
  const anyStarted = async () => (await prompts()).some((text) => /\[(\*|\d+)\]/.test(text))
                                 || (await kernelState()) === 'busy';
  for (let attempt = 1; ; attempt++) {
    await page.locator('.lm-MenuBar-itemLabel', { hasText: /^Run$/ }).click();
    await page.locator('.lm-Menu-itemLabel', { hasText: /^Run All Cells$/ }).click();
    const began = Date.now();
    while (Date.now() - began < 20_000 && !(await anyStarted())) await page.waitForTimeout(500);
    if (await anyStarted()) break;
    if (attempt === 3) fail('Run > Run All Cells started no cell, three times in 60 s: is the kernel connected?');
    log('no cell started yet; asking again');
  }
  log(`running all cells (up to ${options.timeout} s)`);

  // ---- 2. wait until every code cell has an execution count ------------------------------
  const started = Date.now();
  const traceback = page.locator('.jp-OutputArea-output', { hasText: 'Traceback (most recent call last)' });
  for (;;) {
    const texts = await prompts();
    const done = texts.filter((text) => /\[\d+\]/.test(text)).length;
    const finished = texts.length > 0 && done === texts.length && (await kernelState()) === 'idle';
    if (await traceback.count()) {
      fail(`a cell raised an exception:\n${(await traceback.first().innerText()).slice(0, 2000)}`);
    }
    if (finished) {
      log(`all ${texts.length} code cells ran in ${((Date.now() - started) / 1000).toFixed(0)} s`);
      break;
    }
    if (Date.now() - started > runTimeoutMs) {
      fail(`the notebook did not finish within ${options.timeout} s: ${done} of ${texts.length} code cells ran`);
    }
    await page.waitForTimeout(1000);
  }

  // ---- 3. the player and its pictures ------------------------------------------------------
  const player = page.locator('.minicb-step-player').first();
  await player.waitFor({ timeout: 60_000 })
    .catch(() => fail('no element with class minicb-step-player: the StepPlayer widget did not render'));
  await player.scrollIntoViewIfNeeded();
  // add_class puts the class on the widget's own element, which for an Image widget is the <img>.
  const picture = (name) => player.locator(`img.${name}, .${name} img`).first();
  const timeline = picture('minicb-slot-timeline');
  const blockMap = picture('minicb-block-map');
  const queues = player.locator('.minicb-queues').first();
  const handle = player.locator('.noUi-handle').first();
  const readout = player.locator('.widget-readout').first();
  for (const [name, locator] of [['slot timeline', timeline], ['block map', blockMap], ['queues', queues],
                                 ['slider handle', handle], ['slider readout', readout]]) {
    await locator.waitFor({ timeout: 30_000 }).catch(() => fail(`the step player has no ${name}`));
  }

  const pictureState = async () => Promise.all([timeline, blockMap].map((img) => img.evaluate((element) => ({
    src: element.src, width: element.naturalWidth, height: element.naturalHeight, complete: element.complete,
  }))));
  const assertRendered = async (label) => {
    const [line, blocks] = await pictureState();
    for (const [name, state] of [['slot timeline', line], ['block map', blocks]]) {
      if (!state.complete || state.width === 0 || state.height === 0) {
        fail(`${label}: the ${name} image did not render (natural size ${state.width}x${state.height})`);
      }
    }
    return [line, blocks];
  };
  // Wait until the player shows `step` and its pictures are new (the kernel draws them).
  const showStep = async (step, before, label) => {
    const deadline = Date.now() + 60_000;
    for (;;) {
      const value = Number(await handle.getAttribute('aria-valuenow'));
      const [line, blocks] = await pictureState();
      const changed = before === null || (line.src !== before[0].src && blocks.src !== before[1].src);
      if (value === step && changed && line.complete && blocks.complete) break;
      if (Date.now() > deadline) {
        fail(`${label}: after moving the slider to step ${step} the player shows step ${value}; slot timeline `
             + `${line.src === before?.[0].src ? 'unchanged' : 'changed'}, block map `
             + `${blocks.src === before?.[1].src ? 'unchanged' : 'changed'} after 60 s`);
      }
      await page.waitForTimeout(300);
    }
    await page.waitForTimeout(300); // let the queues' HTML arrive with the images
    return assertRendered(label);
  };
  // "waiting (3)", "running (4)", "finished (5)" in the queues table.
  const queueCounts = async () => {
    const text = await queues.innerText();
    const count = (name) => Number((text.match(new RegExp(`^\\s*${name} \\((\\d+)\\)`, 'm')) || [])[1] ?? NaN);
    return { waiting: count('waiting'), running: count('running'), finished: count('finished'), text };
  };

  const lastStep = Number(await handle.getAttribute('aria-valuemax'));
  const notebookStep = Number(await handle.getAttribute('aria-valuenow')); // the notebook's own cell moved it
  log(`player found: steps 0..${lastStep}, showing step ${notebookStep}`);
  const initial = await assertRendered('after running the notebook');

  // ---- 4. move the slider: Home with the keyboard, then a step typed into the readout ------
  await handle.focus();
  await page.keyboard.press('Home');
  const atStart = await showStep(0, notebookStep === 0 ? null : initial, 'keyboard Home on the slider');
  const start = await queueCounts();
  await player.screenshot({ path: shot('06-player-step-a.png') });
  log(`step 0: ${start.waiting} waiting, ${start.running} running, ${start.finished} finished`);

  // Halfway through the continuous run, as the notebook set it; at least a third of the slider.
  const target = Math.max(notebookStep, Math.ceil(lastStep / 3));
  await readout.click();
  await page.keyboard.press('ControlOrMeta+A');
  await page.keyboard.type(String(target));
  await page.keyboard.press('Enter');
  await showStep(target, atStart, `typing ${target} into the slider readout`);
  const later = await queueCounts();
  await player.screenshot({ path: shot('06-player-step-b.png') });
  log(`step ${target}: ${later.waiting} waiting, ${later.running} running, ${later.finished} finished`);
  if (!(later.finished >= 1)) {
    fail(`at step ${target} no request has finished, so the timeline shows no eviction; queues:\n${later.text}`);
  }
  if (!(later.waiting < start.waiting)) {
    fail(`at step ${target} the waiting queue did not shrink since step 0 (${start.waiting} -> ${later.waiting}), `
         + `so no freed slot was refilled; queues:\n${later.text}`);
  }

  // ---- 5. no broken widgets anywhere on the page --------------------------------------------
  const broken = await page.getByText('Error displaying widget').count();
  if (broken) fail(`the page shows "Error displaying widget" ${broken} time(s)`);
  const loading = await page.getByText('Loading widget...').count();
  if (loading) fail(`the page still shows "Loading widget..." ${loading} time(s) after the run`);

  // The whole notebook in one picture: a viewport tall enough for every cell.
  const height = await page.locator('.jp-NotebookPanel .jp-Notebook, .jp-NotebookPanel .jp-Notebook *')
    .evaluateAll((elements) => Math.max(...elements.map((element) => element.scrollHeight)));
  await page.setViewportSize({ width: 1500, height: Math.min(Math.max(height + 200, 1100), 16000) });
  await page.locator('.jp-NotebookPanel .jp-Cell').first().scrollIntoViewIfNeeded();
  await page.waitForTimeout(1500);
  await page.screenshot({ path: shot('06-notebook.png') });
  log(`PASS: the step player renders and follows its slider; screenshots in ${options.out}/`);
} catch (error) {
  exitCode = 1;
  console.error(`[browser-check] FAIL: ${error instanceof CheckFailed ? error.message : error.stack}`);
  await page.screenshot({ path: shot('06-failure.png') }).catch(() => {});
  console.error(`[browser-check] the page at the moment of failure: ${shot('06-failure.png')}`);
} finally {
  await browser.close();
}
process.exit(exitCode);
