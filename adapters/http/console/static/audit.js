// Audit (an admin key's page): the audit trail of GET /admin/audit, newest first — what
// admins changed (tenants, keys, rollouts) and what the server did on its own (rollbacks,
// key reloads): when (local time), the event, who (the admin tenant; "automatic" for the
// server's own changes; "—" where the server has no keys), its subject and details. The
// newest 100 at first; "Load older" asks for the page before the oldest shown
// (`until=<its at>`) while the server has more. A filter box narrows the rows shown (a
// substring of the event, actor, subject or details; in the browser, not the server).
// Refreshed every 10 s while the tab is shown and the browser tab visible: the new events
// merged in (none twice), the filter and the older pages kept. Events whose name says
// "rolled back" stand out (.audit-row.warning). Every field is the server's string (a
// rollout or tenant name is anyone's text): rendered as text only.
import { el, clear } from './dom.js';
import { cell, count, poll, table, useStylesheet } from './console-data.js';

const REFRESH_MS = 10000;
const PAGE = 100;

/** Unix seconds as local time, ISO-like: "2025-11-27 14:03:05". */
export function localTime(seconds) {
  const date = new Date(Number(seconds) * 1000);
  if (Number.isNaN(date.getTime())) return '–';
  const p = (n) => String(n).padStart(2, '0');
  return (
    `${date.getFullYear()}-${p(date.getMonth() + 1)}-${p(date.getDate())} ` +
    `${p(date.getHours())}:${p(date.getMinutes())}:${p(date.getSeconds())}`
  );
}

/** Who made the change: the admin tenant, "automatic" (the server), "—" (none: an open server). */
export function actorText(actor) {
  return actor === null || actor === undefined || actor === '' ? '—' : String(actor);
}

/** The details as compact text: "key: value; key: value" (strings as they are, the rest as JSON). */
export function detailsText(details) {
  if (details === null || details === undefined) return '';
  if (typeof details !== 'object' || Array.isArray(details)) return JSON.stringify(details);
  return Object.entries(details)
    .map(([key, value]) => `${key}: ${typeof value === 'string' ? value : JSON.stringify(value)}`)
    .join('; ');
}

/** An event that should stand out: an automatic rollback. */
export function isWarning(event) {
  return String(event.event || '').toLowerCase().includes('rolled back');
}

/** The text the filter searches: event, actor, subject and details, lower-cased. */
function haystack(event) {
  return [event.event, actorText(event.actor), event.subject, detailsText(event.details)].join('\n').toLowerCase();
}

/** An event's identity (the API gives none): all of it. */
function identity(event) {
  return JSON.stringify([event.at, event.event, event.actor, event.subject, event.details]);
}

/** An event's row: every field as text. */
export function eventRow(event) {
  const details = detailsText(event.details);
  const date = new Date(Number(event.at) * 1000);
  const row = el(
    'tr',
    { class: `audit-row${isWarning(event) ? ' warning' : ''}`, attrs: { 'data-at': String(event.at) } },
    cell(localTime(event.at), { title: Number.isNaN(date.getTime()) ? null : `${date.toISOString()} (unix ${event.at})` }),
    cell(String(event.event)),
    cell(actorText(event.actor)),
    cell(String(event.subject)),
    cell(details || '—', { title: details || null }),
  );
  const names = ['audit-time', 'audit-event', 'audit-actor', 'audit-subject', 'audit-details'];
  names.forEach((name, i) => row.cells[i].classList.add(name));
  if (event.actor === null || event.actor === undefined) row.cells[2].classList.add('muted');
  return row;
}

export function mount(root, ctx) {
  useStylesheet();
  const status = el('p', { class: 'status-line', attrs: { id: 'audit-status' }, text: 'Loading…' });
  const error = el('p', { class: 'error', attrs: { id: 'audit-error', role: 'alert' } });
  const filter = el('input', {
    attrs: { id: 'audit-filter', type: 'search', autocomplete: 'off', placeholder: 'Filter: event, actor, subject, details', 'aria-label': 'Filter the events shown' },
    on: { input: () => render() },
  });
  const older = el('button', { attrs: { type: 'button', id: 'audit-older', hidden: true }, text: 'Load older', on: { click: () => loadOlder() } });
  const olderError = el('p', { class: 'error', attrs: { id: 'audit-older-error', role: 'alert' } });
  const { node, body } = table('audit-table', [
    { label: 'Time' },
    { label: 'Event' },
    { label: 'Actor' },
    { label: 'Subject' },
    { label: 'Details' },
  ]);
  const empty = el('p', { class: 'notice', attrs: { id: 'audit-empty', hidden: true } });
  const controls = el('div', { class: 'row audit-controls', attrs: { hidden: true } }, filter);
  const tableBox = el('div', { class: 'table-box audit-box', attrs: { hidden: true } }, node);
  const more = el('div', { class: 'row audit-more' }, older);
  root.append(
    el('div', { class: 'row page-head' }, el('h2', { text: 'Audit' }), el('span', { class: 'muted', text: 'admins’ changes and the server’s own, newest first' })),
    status,
    error,
    controls,
    tableBox,
    empty,
    more,
    olderError,
  );

  let events = []; // newest first, each once
  let seen = new Set(); // their identities
  let hasMore = false; // the server holds events older than the oldest shown
  let epoch = 0; // a new list (after a refusal, or a gap): an older page asked before is dropped
  let loaded = false;
  let updated = '';

  const merge = (page) => {
    let added = 0;
    for (const event of page) {
      const id = identity(event);
      if (seen.has(id)) continue;
      seen.add(id);
      events.push(event);
      added += 1;
    }
    if (added) events.sort((a, b) => b.at - a.at); // stable: the server's order kept for ties
    return added;
  };

  const reset = (page, more) => {
    epoch += 1;
    events = [];
    seen = new Set();
    merge(page);
    hasMore = more;
  };

  // The rows are rebuilt only when the events or the filter changed (a selection in the
  // table survives a refresh that brought nothing new).
  let shown = 0;
  function render(rows = true) {
    if (!loaded) return;
    const needle = filter.value.trim().toLowerCase();
    if (rows) {
      const matching = needle ? events.filter((e) => haystack(e).includes(needle)) : events;
      clear(body);
      for (const event of matching) body.appendChild(eventRow(event));
      shown = matching.length;
    }
    controls.hidden = false;
    tableBox.hidden = shown === 0;
    empty.hidden = shown > 0;
    empty.textContent = events.length ? 'No event shown matches the filter.' : 'No audit event yet: admins’ changes and automatic rollbacks appear here.';
    older.hidden = !hasMore;
    const counted = needle ? `${count(shown)} of ${count(events.length)} event(s) shown` : `${count(events.length)} event(s)`;
    status.textContent = `${counted}${hasMore ? ' · older ones on the server' : ''} · updated ${updated}`;
  }

  const failed = (e) => {
    error.textContent = e.message || String(e);
    status.textContent = '';
    loaded = false;
    reset([], false); // nothing stale under a refusal
    clear(body);
    controls.hidden = true;
    tableBox.hidden = true;
    empty.hidden = true;
    older.hidden = true;
  };

  /** The newest events: those since the newest shown, merged; past a page of them (a gap
   * between), the newest page alone (its older ones one "Load older" away). */
  const tick = async () => {
    const newest = loaded && events.length ? events[0].at : null;
    const query = new URLSearchParams({ limit: String(PAGE) });
    if (newest !== null) query.set('since', String(newest));
    const before = epoch;
    const data = await ctx.json(`/admin/audit?${query}`);
    if (stopped || before !== epoch) return;
    const page = Array.isArray(data.data) ? data.data : [];
    let changed = true;
    if (newest === null || data.has_more) reset(page, Boolean(data.has_more));
    else changed = merge(page) > 0;
    error.textContent = '';
    loaded = true;
    updated = new Date().toLocaleTimeString([], { hour12: false });
    render(changed);
  };

  async function loadOlder() {
    if (!events.length) return;
    const before = epoch;
    const oldest = events[events.length - 1].at;
    older.disabled = true;
    olderError.textContent = '';
    try {
      const query = new URLSearchParams({ limit: String(PAGE), until: String(oldest) });
      const data = await ctx.json(`/admin/audit?${query}`);
      if (stopped || before !== epoch) return;
      merge(Array.isArray(data.data) ? data.data : []);
      hasMore = Boolean(data.has_more);
      render();
    } catch (e) {
      if (!stopped) olderError.textContent = e.message || String(e);
    } finally {
      older.disabled = false;
    }
  }

  // One load at a time, every REFRESH_MS after the last, while the browser tab is visible.
  let stopped = false;
  const poller = poll(tick, REFRESH_MS, (e) => {
    if (!stopped) failed(e);
  });
  return {
    unmount() {
      stopped = true;
      poller.stop();
    },
  };
}
