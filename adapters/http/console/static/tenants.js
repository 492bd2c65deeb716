// Tenants and usage (an admin key's page): each tenant of the keys file with its faces,
// models and limits, and its usage today (UTC): requests, tokens, 429s; and the last 7 UTC
// days' tokens and requests per tenant (OpenAI's usage API) as small bar charts: CSS bars
// (console.css's .bar.h0 ... .h20), no library, no inline style. Refreshed every 5 s.
// Tenant ids and model names are the server's strings: rendered as text only.
import { el, clear } from './dom.js';
import { cell, count, poll, table, useStylesheet, when } from './console-data.js';

const REFRESH_MS = 5000;
const LIMITS = [
  ['requests_per_second', 'req/s'],
  ['requests_per_minute', 'req/min'],
  ['tokens_per_minute', 'tokens/min'],
  ['max_concurrent_streams', 'streams'],
  ['requests_per_day', 'req/day'],
  ['tokens_per_day', 'tokens/day'],
];
const DAY_S = 86400;
const WEEK_DAYS = 7;
const BAR_LEVELS = 20; // console.css: .bar.h0 (none) ... .bar.h20 (the column's most)
const USAGE_COLUMNS = [
  { label: 'Requests', num: true },
  { label: 'Prompt tokens', num: true },
  { label: 'Completion tokens', num: true },
  { label: '429s', num: true },
  { label: 'Errors', num: true },
];

function limitsCell(limits) {
  const set = LIMITS.filter(([name]) => limits[name] !== null && limits[name] !== undefined);
  if (!set.length) return cell(el('span', { class: 'muted', text: 'unlimited' }));
  return cell(el('span', {}, ...set.map(([name, label]) => el('span', { class: 'pill limit', text: `${count(limits[name])} ${label}` }))));
}

function usageCells(usage) {
  return [
    cell(count(usage.requests), { num: true }),
    cell(count(usage.prompt_tokens), { num: true }),
    cell(count(usage.completion_tokens), { num: true }),
    cell(el('span', { class: usage.rate_limited ? 'limited' : null, text: count(usage.rate_limited) }), { num: true }),
    cell(count(usage.errors), { num: true }),
  ];
}

function tinkerCell(tinker) {
  if (!tinker) return cell('–');
  const parts = [
    `${count(tinker.trained_tokens)} trained`,
    `${count(tinker.sampled_tokens)} sampled`,
    `${count(tinker.checkpoints_saved)} checkpoints`,
  ];
  return cell(parts.join(' · '), { title: `prefill: ${count(tinker.prefill_tokens)} tokens` });
}

function tenantRow(tenant, withTinker) {
  const name = el('span', {}, el('strong', { text: tenant.id }), tenant.admin ? el('span', { class: 'pill admin', text: 'admin' }) : null);
  const models = tenant.models === null ? el('span', { class: 'muted', text: 'all' }) : tenant.models.join(', ');
  return el(
    'tr',
    { attrs: { 'data-tenant': tenant.id } },
    cell(name),
    cell(tenant.faces.join(', ')),
    cell(models),
    cell(String(tenant.weight), { num: true }),
    limitsCell(tenant.limits),
    ...usageCells(tenant.usage),
    withTinker ? tinkerCell(tenant.tinker_usage) : null,
  );
}

function otherRow(other, keyed) {
  let label;
  if (other.no_key) label = el('span', { class: 'muted', text: keyed ? 'no or unknown key (refused: 401)' : 'no key (open server)' });
  else if (other.id === 'other') label = el('span', { class: 'muted', text: 'other (past the tenants kept)' });
  else label = el('span', {}, el('strong', { text: other.id }), el('span', { class: 'muted', text: ' (not in the keys file now)' }));
  return el('tr', { attrs: { 'data-tenant': other.id } }, cell(label), ...usageCells(other.usage));
}

// The last 7 days: GET /v1/organization/usage/completions, one bucket per UTC day.

/** The usage API's query: the 7 UTC days ending today (`dayStart`: today's UTC midnight). */
export function weekPath(dayStart) {
  const start = Math.round(dayStart) - (WEEK_DAYS - 1) * DAY_S;
  const query = new URLSearchParams({ start_time: String(start), bucket_width: '1d', group_by: 'project_id', limit: String(WEEK_DAYS) });
  return `/v1/organization/usage/completions?${query}`;
}

/** A UTC day (its midnight, Unix seconds) as YYYY-MM-DD. */
function day(seconds) {
  return new Date(seconds * 1000).toISOString().slice(0, 10);
}

/**
 * The page's buckets as rows: [{id, tokens: [7], requests: [7]}], `id` null for requests
 * without a key. `known` (the keys file's tenant ids) come first, in their order, with or
 * without usage; then the other ids found (tenants no longer in the keys file), then no key.
 */
export function weekRows(page, known) {
  const buckets = (page.data || []).slice(0, WEEK_DAYS);
  const rows = new Map();
  const row = (id) => {
    if (!rows.has(id)) rows.set(id, { id, tokens: buckets.map(() => 0), requests: buckets.map(() => 0) });
    return rows.get(id);
  };
  for (const id of known) row(id);
  buckets.forEach((bucket, i) => {
    for (const result of bucket.results || []) {
      const id = result.project_id === null || result.project_id === undefined || result.project_id === '' ? null : String(result.project_id);
      const r = row(id);
      r.tokens[i] += (Number(result.input_tokens) || 0) + (Number(result.output_tokens) || 0);
      r.requests[i] += Number(result.num_model_requests) || 0;
    }
  });
  const keys = new Set(known);
  const rank = (r) => (r.id === null ? 2 : keys.has(r.id) ? 0 : 1);
  return { days: buckets.map((b) => b.start_time), rows: [...rows.values()].sort((a, b) => rank(a) - rank(b)) };
}

/** A bar's level: 0 for none, else 1 ... BAR_LEVELS of `most` (a little usage still shows). */
export function level(value, most) {
  if (!value || !most) return 0;
  return Math.min(BAR_LEVELS, Math.max(1, Math.round((value / most) * BAR_LEVELS)));
}

/** One chart: a bar per day, its value and day in its title; the values as its label. */
function bars(values, days, most, unit, kind) {
  const label = values.map((v, i) => `${day(days[i])}: ${count(v)}`).join(', ');
  return el(
    'span',
    { class: `bars ${kind}`, attrs: { role: 'img', 'aria-label': `${unit} per day (UTC): ${label}` } },
    ...values.map((v, i) =>
      el('span', {
        class: `bar h${level(v, most)}${i === values.length - 1 ? ' today' : ''}`,
        attrs: { title: `${day(days[i])}: ${count(v)} ${unit}`, 'data-value': String(v) },
      }),
    ),
  );
}

function weekName(id, known, keyed) {
  if (id === null) return el('span', { class: 'muted', text: keyed ? 'no key' : 'no key (open server)' });
  if (known.has(id)) return el('strong', { text: id });
  return el('span', {}, el('strong', { text: id }), el('span', { class: 'muted', text: ' (not in the keys file now)' }));
}

function sum(values) {
  return values.reduce((a, b) => a + b, 0);
}

/** The panel's table (the bars of a column share one scale: the column's busiest day). */
function weekTable(week, known, keyed) {
  const { node, body } = table('usage-week-table', [
    { label: 'Tenant' },
    { label: 'Tokens per day' },
    { label: 'Tokens', num: true },
    { label: 'Requests per day' },
    { label: 'Requests', num: true },
  ]);
  const mostTokens = Math.max(0, ...week.rows.flatMap((r) => r.tokens));
  const mostRequests = Math.max(0, ...week.rows.flatMap((r) => r.requests));
  for (const r of week.rows) {
    const tokens = sum(r.tokens);
    const requests = sum(r.requests);
    body.appendChild(
      el(
        'tr',
        { attrs: { 'data-tenant': r.id === null ? '' : r.id, 'data-tokens': String(tokens), 'data-requests': String(requests) } },
        cell(weekName(r.id, known, keyed)),
        cell(bars(r.tokens, week.days, mostTokens, 'tokens', 'tokens')),
        cell(count(tokens), { num: true }),
        cell(bars(r.requests, week.days, mostRequests, 'requests', 'requests')),
        cell(count(requests), { num: true }),
      ),
    );
  }
  return node;
}

export function mount(root, ctx) {
  useStylesheet();
  const status = el('p', { class: 'status-line', attrs: { id: 'tenants-status' }, text: 'Loading…' });
  const error = el('p', { class: 'error', attrs: { id: 'tenants-error', role: 'alert' } });
  const tenantsBox = el('div', { class: 'table-box' });
  const othersBox = el('div', { class: 'table-box' });
  const weekRange = el('span', { class: 'muted', attrs: { id: 'usage-week-range' } });
  const weekError = el('p', { class: 'error', attrs: { id: 'usage-week-error', role: 'alert' } });
  const weekBox = el('div', { class: 'table-box' });
  const weekPanel = el(
    'section',
    { class: 'panel usage-week', attrs: { id: 'usage-week', 'aria-label': 'Last 7 days', hidden: true } },
    el('div', { class: 'row page-head' }, el('h3', { text: 'Last 7 days' }), weekRange),
    weekError,
    weekBox,
  );
  root.append(
    el('div', { class: 'row page-head' }, el('h2', { text: 'Tenants and usage' }), el('span', { class: 'muted', text: 'usage since midnight UTC' })),
    status,
    error,
    tenantsBox,
    othersBox,
    weekPanel,
  );

  const render = (data) => {
    clear(tenantsBox);
    clear(othersBox);
    const withTinker = Boolean(data.tinker);
    if (data.keyed) {
      const columns = [
        { label: 'Tenant' },
        { label: 'Faces' },
        { label: 'Models' },
        { label: 'Weight', num: true },
        { label: 'Limits' },
        ...USAGE_COLUMNS,
        ...(withTinker ? [{ label: 'Tinker today' }] : []),
      ];
      const { node, body } = table('tenants-table', columns);
      for (const tenant of data.tenants) body.appendChild(tenantRow(tenant, withTinker));
      tenantsBox.appendChild(node);
    } else {
      tenantsBox.appendChild(
        el('p', {
          class: 'notice',
          attrs: { id: 'tenants-open' },
          text: 'This server has no keys file: it is open, without tenants or limits. Start it with --api-keys-file to have tenants.',
        }),
      );
    }
    if (data.others.length) {
      othersBox.appendChild(el('h3', { text: data.keyed ? 'Other usage' : 'Usage' }));
      const { node, body } = table('usage-others', [{ label: 'Who' }, ...USAGE_COLUMNS]);
      for (const other of data.others) body.appendChild(otherRow(other, data.keyed));
      othersBox.appendChild(node);
    }
    const viewer = data.viewer ? ` · you: ${data.viewer}` : '';
    status.textContent = `${data.tenants.length} tenant(s) · since ${when(data.day_start)}${viewer} · updated ${new Date().toLocaleTimeString([], { hour12: false })}`;
  };

  // The usage API's 7 days, from the server's own midnight (not the browser's clock). Its
  // failure is the panel's alone: the tables above stay.
  const renderWeek = async (data) => {
    const known = data.tenants.map((t) => String(t.id));
    let page;
    try {
      page = await ctx.json(weekPath(data.day_start));
    } catch (e) {
      weekPanel.hidden = false;
      weekError.textContent = `The usage of the last 7 days is not available: ${e.message || e}`;
      weekRange.textContent = '';
      clear(weekBox);
      return;
    }
    const week = weekRows(page, known);
    weekPanel.hidden = false;
    weekError.textContent = '';
    clear(weekBox);
    if (!week.days.length) return;
    weekRange.textContent = `UTC days ${day(week.days[0])} to ${day(week.days[week.days.length - 1])} (today so far) · completions' input + output tokens and requests answered · bars scaled to each column's busiest day`;
    if (week.rows.length) weekBox.appendChild(weekTable(week, new Set(known), data.keyed));
    else weekBox.appendChild(el('p', { class: 'muted', attrs: { id: 'usage-week-empty' }, text: 'No completions in these 7 days.' }));
  };

  const poller = poll(
    async () => {
      const data = await ctx.json('/ui/api/tenants');
      error.textContent = '';
      render(data);
      await renderWeek(data);
    },
    REFRESH_MS,
    (e) => {
      error.textContent = e.message || String(e);
      status.textContent = '';
      clear(tenantsBox); // nothing stale under a refusal
      clear(othersBox);
      weekPanel.hidden = true;
      clear(weekBox);
    },
  );
  return {
    unmount() {
      poller.stop();
    },
  };
}
