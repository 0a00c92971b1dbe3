// The server's live dashboard in a real browser: headless Chromium, driven by playwright-core.
//
// tools/dashboard_check.sh starts `python -m minicb serve` (4 slots) and runs this file. We:
//   1. open the dashboard (GET /) and wait until its feed (/v1/dashboard/steps) says hello;
//   2. fire more streaming chat requests than there are slots, a few at a time, through
//      the OpenAI API (as any client would), and read every stream to its [DONE];
//   3. while they run, check that the page shows every slot busy at once ("slots filling"),
//      draws the slot timeline and the block map (coloured pixels on both canvases), lists
//      running and waiting requests, and reports tokens/s above 0;
//   4. check that it shows a request finishing and its slot refilled by a waiting request
//      (the × and + of the timeline, counted in the page's data-finished / data-refills);
//   5. once every request has ended: the page counted them all, and its block map comes
//      back to 0 blocks used;
//   6. never a JavaScript error on the page, and its request colours are minicb.viz's.
// Screenshots go to build/screenshots/09-dashboard-*.png. Any failure exits non-zero with a
// message saying what.
//
//   node tools/dashboard_check.mjs --url http://127.0.0.1:PORT [--out DIR] [--requests N]

import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';

import { chromium } from 'playwright-core';

const { values: options } = parseArgs({
  options: {
    url: { type: 'string' },
    out: { type: 'string', default: 'build/screenshots' },
    requests: { type: 'string', default: '10' },
    'max-tokens': { type: 'string', default: '40' },
    colors: { type: 'string', default: '{}' }, // {"id,prefill": "rgb(r,g,b)"} from minicb.viz.request_color
  },
});
if (!options.url) {
  console.error('usage: node tools/dashboard_check.mjs --url http://127.0.0.1:PORT');
  process.exit(2);
}
mkdirSync(options.out, { recursive: true });
const shot = (name) => join(options.out, `09-dashboard-${name}.png`);
const numRequests = Number(options.requests);

class CheckFailed extends Error {}
const fail = (message) => { throw new CheckFailed(message); };
const log = (message) => console.log(`[dashboard-check] ${message}`);

// Questions of different lengths, so requests finish at different steps and slots refill.
const QUESTIONS = [
  'What is 2+2?', 'Name three colours.', 'Write a haiku about the sea.', 'What is the capital of France?',
  'Explain photosynthesis in two sentences.', 'Say hello.', 'List four animals that live in the ocean.',
  'What is a prime number?', 'Give me a tip for sleeping well.', 'Why is the sky blue?',
  'Count from one to ten in words.', 'What does a librarian do?',
];

async function streamChat(i) {
  const response = await fetch(`${options.url}/v1/chat/completions`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({
      messages: [{ role: 'user', content: QUESTIONS[i % QUESTIONS.length] }],
      max_tokens: Number(options['max-tokens']) - (i % 3) * 10, temperature: 0, stream: true,
    }),
  });
  if (response.status !== 200) fail(`request ${i} answered HTTP ${response.status}: ${await response.text()}`);
  const text = await response.text(); // the whole event stream, once it has ended
  if (!text.trimEnd().endsWith('data: [DONE]')) fail(`request ${i}'s stream did not end with [DONE]`);
  return text;
}

const browser = await chromium.launch({
  executablePath: '/usr/bin/chromium',
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
         '--no-first-run', '--disable-sync'],
});
const page = await browser.newPage({ viewport: { width: 1500, height: 1000 } });
const pageErrors = [];
page.on('pageerror', (error) => pageErrors.push(String(error)));
let exitCode = 0;

const data = async () => page.evaluate(() => ({ ...document.body.dataset }));
const waitFor = async (what, predicate, timeoutMs) => {
  const began = Date.now();
  for (;;) {
    const state = await data();
    if (await predicate(state)) return state;
    if (Date.now() - began > timeoutMs) fail(`${what} within ${timeoutMs / 1000} s; the page's counters: ${JSON.stringify(state)}`);
    await page.waitForTimeout(200);
  }
};
// Non-white, opaque pixels of a canvas: something was drawn there.
const paintedPixels = (id) => page.evaluate((canvasId) => {
  const canvas = document.getElementById(canvasId);
  const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  let painted = 0;
  for (let i = 0; i < pixels.length; i += 4) {
    const [r, g, b, a] = pixels.slice(i, i + 4);
    if (a > 0 && (r < 235 || g < 235 || b < 235) && !(r === g && g === b)) painted++;
  }
  return painted;
}, id);

try {
  // ---- 1. the page and its feed ------------------------------------------------------------
  await page.goto(options.url, { waitUntil: 'domcontentloaded', timeout: 60_000 });
  await waitFor('the dashboard did not connect to /v1/dashboard/steps', (s) => s.connected === '1', 30_000);
  const slots = Number((await page.locator('#maxbusy').textContent()).split(' of ')[1]);
  log(`connected: ${await page.locator('#subtitle').textContent()}`);
  if (!(slots >= 1)) fail(`the page did not learn the number of slots: "${await page.locator('#maxbusy').textContent()}"`);
  if (numRequests <= slots) fail(`--requests ${numRequests} must exceed the ${slots} slots, or no slot is ever refilled`);
  await page.screenshot({ path: shot('idle'), fullPage: true });

  // ---- 2. the load: more requests than slots, two at a time, 300 ms apart --------------------
  log(`sending ${numRequests} streaming chat requests`);
  const streams = [];
  const sending = (async () => {
    for (let i = 0; i < numRequests; i += 2) {
      // A failed stream is kept as its error (checked below), not left as an unhandled rejection.
      for (const j of [i, i + 1].filter((k) => k < numRequests)) streams.push(streamChat(j).catch((e) => e));
      await new Promise((resolve) => setTimeout(resolve, 300));
    }
  })();

  // ---- 3. slots filling ---------------------------------------------------------------------
  await waitFor(`the page never showed all ${slots} slots busy`, (s) => Number(s.maxBusy) >= slots, 120_000);
  const busy = { timeline: await paintedPixels('timeline'), blocks: await paintedPixels('blockmap') };
  if (busy.timeline === 0) fail('the slot timeline canvas is blank while every slot is busy');
  if (busy.blocks === 0) fail('the block map canvas is blank while requests hold KV blocks');
  const running = await page.locator('#runq .chip').count();
  if (running === 0) fail('the running queue lists no request while every slot is busy');
  await page.waitForTimeout(1200); // the next block map (they come a few times a second) and tokens/s
  const tps = Number(await page.locator('#tps').textContent());
  if (!(tps > 0)) fail(`tokens/s reads ${tps} while requests are decoding`);
  log(`all ${slots} slots busy; ${running} running, ${await page.locator('#waitq .chip').count()} waiting, ` +
      `${tps} tokens/s; timeline ${busy.timeline} and block map ${busy.blocks} coloured pixels`);
  await page.screenshot({ path: shot('busy'), fullPage: true });

  // ---- 4. a request finishes and its slot is refilled ----------------------------------------------
  const refilled = await waitFor('the page never showed a finished request\'s slot refilled',
                                 (s) => Number(s.finished) >= 1 && Number(s.refills) >= 1, 180_000);
  log(`finished ${refilled.finished}, refills ${refilled.refills} at step ${refilled.steps}`);
  const events = await page.locator('#events').textContent();
  if (!/finished \((stop|length)\)/.test(events) || !/refills slot \d+/.test(events)) {
    fail(`the events panel does not tell of a finish and a refill:\n${events}`);
  }
  await page.screenshot({ path: shot('refill'), fullPage: true });

  // ---- 5. everything ends ------------------------------------------------------------------------
  await sending;
  const failed = (await Promise.all(streams)).filter((result) => result instanceof Error);
  if (failed.length) fail(`${failed.length} of ${numRequests} requests failed; the first: ${failed[0].message}`);
  log(`all ${numRequests} streams ended with [DONE]`);
  await waitFor(`the page did not count all ${numRequests} requests finished`,
                (s) => Number(s.finished) >= numRequests, 30_000);
  await page.waitForFunction(() => / 0 of \d+ used/.test(document.getElementById('blocktitle').textContent),
                             null, { timeout: 15_000 })
    .catch(async () => fail(`the block map did not come back to 0 blocks used: "${await page.locator('#blocktitle').textContent()}"`));
  await page.screenshot({ path: shot('done'), fullPage: true });

  // ---- 6. no JavaScript errors --------------------------------------------------------------------
  if (pageErrors.length) fail(`the page raised JavaScript errors:\n${pageErrors.join('\n')}`);
  const expected = JSON.parse(options.colors);
  for (const [key, want] of Object.entries(expected)) {
    const [id, prefill] = key.split(',').map(Number);
    const got = await page.evaluate(([i, p]) => requestColor(i, p === 1), [id, prefill]);
    if (got !== want) fail(`request ${id}${prefill ? ' (prefill)' : ''} is ${got} on the page but ${want} in minicb.viz`);
  }
  if (Object.keys(expected).length) log(`${Object.keys(expected).length} request colours match minicb.viz's`);
  log('OK: slots filled, a finished request\'s slot was refilled, every block came back');
} catch (error) {
  exitCode = 1;
  console.error(`[dashboard-check] FAIL: ${error instanceof CheckFailed ? error.message : error.stack}`);
  await page.screenshot({ path: shot('failure'), fullPage: true }).catch(() => {});
} finally {
  await browser.close();
}
process.exit(exitCode);
