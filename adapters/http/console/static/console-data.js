// Helpers of the tenants and training pages: their stylesheet, numbers, bytes and times
// for people, and a poller that stops when its page is left. Every server-provided string
// goes into the page as text (dom.js's el), never as HTML.
import { el } from './dom.js';

const STYLESHEET = '/ui/static/console-data.css';

/** The pages' stylesheet, linked once (CSS must be a <link>: no inline style under the CSP). */
export function useStylesheet() {
  if (document.querySelector(`link[href="${STYLESHEET}"]`)) return;
  document.head.append(el('link', { attrs: { rel: 'stylesheet', href: STYLESHEET } }));
}

/** 1234567 -> "1.2 MiB". */
export function bytes(n) {
  if (n === null || n === undefined) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${value} B` : `${value.toFixed(value >= 100 ? 0 : 1)} ${units[unit]}`;
}

/** An integer with thousands separators ("–" for null). */
export function count(n) {
  return n === null || n === undefined ? '–' : Number(n).toLocaleString('en-US');
}

/** A metric's value: 4 significant digits. */
export function metric(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return '–';
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(3);
  return `${+value.toPrecision(4)}`;
}

/** Unix seconds as a local date and time. */
export function when(seconds) {
  if (!seconds) return '–';
  return new Date(seconds * 1000).toLocaleString([], { hour12: false });
}

/** How long ago (or from now) `seconds` is, roughly: "3 min ago", "in 2 h". */
export function relative(seconds, now = Date.now() / 1000) {
  const delta = seconds - now;
  const abs = Math.abs(delta);
  let text;
  if (abs < 60) text = `${Math.round(abs)} s`;
  else if (abs < 3600) text = `${Math.round(abs / 60)} min`;
  else if (abs < 86400) text = `${(abs / 3600).toFixed(abs < 36000 ? 1 : 0)} h`;
  else text = `${(abs / 86400).toFixed(abs < 864000 ? 1 : 0)} d`;
  return delta >= 0 ? `in ${text}` : `${text} ago`;
}

/**
 * Call `tick()` now and every `intervalMs` after the previous call ended (never two at
 * once), until stop(). A tick's error goes to onError and the polling goes on. While the
 * browser tab is in the background no tick runs; it runs at once when the tab is shown.
 */
export function poll(tick, intervalMs, onError = () => {}) {
  let stopped = false;
  let timer = null;
  let running = false; // one tick at a time: a now() during a tick runs right after it
  let again = false;
  const hidden = () => typeof document !== 'undefined' && document.hidden;
  const run = async () => {
    clearTimeout(timer);
    timer = null;
    running = true;
    try {
      if (!hidden()) await tick();
    } catch (error) {
      if (!stopped) onError(error);
    }
    running = false;
    if (stopped) return;
    if (again) {
      again = false;
      run();
    } else {
      timer = setTimeout(run, intervalMs);
    }
  };
  const now = () => {
    if (stopped) return;
    if (running) {
      again = true;
    } else {
      run();
    }
  };
  const shown = () => {
    if (!hidden()) now();
  };
  if (typeof document !== 'undefined') document.addEventListener('visibilitychange', shown);
  run();
  return {
    stop() {
      stopped = true;
      clearTimeout(timer);
      if (typeof document !== 'undefined') document.removeEventListener('visibilitychange', shown);
    },
    /** Run a tick now (after a click), keeping the schedule: one loop, never two. */
    now,
  };
}

/** A table: `columns` [{label, num}], a <tbody> the caller fills. */
export function table(id, columns) {
  const body = el('tbody');
  const node = el(
    'table',
    { class: 'table data-table', attrs: { id } },
    el('thead', {}, el('tr', {}, ...columns.map((c) => el('th', { class: c.num ? 'num' : null, text: c.label })))),
    body,
  );
  return { node, body };
}

/** A cell: text, or nodes; `num` right-aligns it. */
export function cell(content, { num = false, title = null } = {}) {
  const td = el('td', { class: num ? 'num' : null, attrs: title ? { title } : undefined });
  if (content instanceof Node) td.appendChild(content);
  else td.textContent = content === null || content === undefined ? '–' : String(content);
  return td;
}
