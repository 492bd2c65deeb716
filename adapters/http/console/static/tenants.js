// Tenants and usage (an admin key's page): each tenant of the keys file with its faces,
// models and limits, and its usage today (UTC): requests, tokens, 429s; and the last 7 UTC
// days' tokens and requests per tenant (OpenAI's usage API) as small bar charts: CSS bars
// (console.css's .bar.h0 ... .h20), no library, no inline style. Refreshed every 5 s.
// An admin also changes them here (the admin API: see "Changes" below).
// Tenant ids and model names are the server's strings: rendered as text only.
import { el, append, clear, errorMessage } from './dom.js';
import { cell, count, poll, table, useStylesheet, when } from './console-data.js';

const REFRESH_MS = 5000;
const LIMITS = [
  ['requests_per_second', 'req/s'],
  ['requests_per_minute', 'req/min'],
  ['tokens_per_minute', 'tokens/min'],
  ['max_concurrent_streams', 'streams'],
  ['requests_per_day', 'req/day'],
  ['tokens_per_day', 'tokens/day'],
  ['max_output_tokens', 'max output'],
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

// Changes (the admin API, /admin/tenants): a tenant created or edited (PUT with its full
// settings: a limit left empty is unlimited), a key minted (shown once, in the box, kept
// nowhere: not in storage, not in a variable once the box is closed) or revoked, a tenant
// deleted. The list of /admin/tenants is the one with every tenant (a tenant without keys
// too); the table above is /ui/api/tenants' (usage). Without a keys file the admin API
// answers 409: its message is shown once, instead of the controls, and not asked again.

const FACES = ['openai', 'tinker', 'admin'];
const DEFAULT_FACES = ['openai', 'tinker'];

function adminPath(id, ...rest) {
  return ['/admin/tenants', id, ...rest].map((part, i) => (i ? encodeURIComponent(part) : part)).join('/');
}

/**
 * A tenant's settings as the admin API's PUT takes them, from the form's text:
 * `{faces: [..], models: 'a, b', weight: '1', limits: {name: '10' | ''}}` ->
 * `{body}` (every field: an empty limit is null, unlimited; empty models, null: all), or
 * `{error}` for text that is no number. The server checks the values themselves.
 */
export function tenantSettings({ faces, models, weight, limits }) {
  const names = String(models || '')
    .split(',')
    .map((m) => m.trim())
    .filter((m) => m);
  const text = String(weight ?? '').trim();
  if (text === '' || !Number.isFinite(Number(text))) return { error: 'The weight is not a number (1 is the default).' };
  const body = { faces: [...faces], models: names.length ? names : null, weight: Number(text) };
  for (const [name, label] of LIMITS) {
    const value = String(limits[name] ?? '').trim();
    if (value === '') body[name] = null;
    else if (!Number.isInteger(Number(value))) return { error: `${label} (${name}) is not a whole number: leave it empty for unlimited.` };
    else body[name] = Number(value);
  }
  return { body };
}

/** The box that shows a minted key once: its text is the only copy, gone when closed. */
class KeyBox {
  constructor() {
    this.root = el('section', { class: 'panel new-key-box', attrs: { id: 'tenant-new-key', hidden: true, 'aria-live': 'polite', 'aria-label': 'New API key' } });
  }

  show(minted) {
    clear(this.root);
    const value = el('code', { class: 'new-key-value', attrs: { id: 'tenant-new-key-value' }, text: minted.key });
    const copied = el('span', { class: 'muted small', attrs: { id: 'tenant-new-key-copied', role: 'status' } });
    this.root.append(
      el('div', { class: 'row page-head' }, el('h3', { text: 'New API key for ' }, el('span', { class: 'tenant-name', text: minted.tenant })), el('span', { class: 'muted', text: `id ${minted.id}` })),
      el('p', {
        class: 'new-key-warning',
        attrs: { id: 'tenant-new-key-note' },
        text: 'Copy it now: it will not be shown again. The server keeps only its digest, and this page keeps it nowhere (no storage); once this box is closed it is gone. Lost? Mint another and revoke this one.',
      }),
      value,
      el(
        'div',
        { class: 'row' },
        el('button', { class: 'primary', attrs: { type: 'button', id: 'tenant-new-key-copy' }, text: 'Copy', on: { click: () => copyKey(value, copied) } }),
        el('button', { attrs: { type: 'button', id: 'tenant-new-key-dismiss' }, text: 'Done: close and forget it', on: { click: () => this.dismiss() } }),
        copied,
      ),
    );
    this.root.hidden = false;
    this.root.scrollIntoView({ block: 'nearest' });
  }

  dismiss() {
    const selection = window.getSelection();
    if (selection && this.root.contains(selection.anchorNode)) selection.removeAllRanges();
    clear(this.root);
    this.root.hidden = true;
  }
}

/** Copy the key's text: the clipboard API, else the text selected and execCommand('copy'). */
async function copyKey(node, status) {
  status.textContent = '';
  try {
    await navigator.clipboard.writeText(node.textContent);
    status.textContent = 'Copied.';
    return;
  } catch {
    /* no clipboard API here (or refused): select it instead */
  }
  const range = document.createRange();
  range.selectNodeContents(node);
  const selection = window.getSelection();
  selection.removeAllRanges();
  selection.addRange(range);
  let done = false;
  try {
    done = document.execCommand('copy');
  } catch {
    done = false;
  }
  status.textContent = done ? 'Copied.' : 'The browser refused to copy: the key is selected, press Ctrl+C (⌘C).';
}

/** A tenant's row of the changes' table: built once, its name and keys updated in place. */
class TenantAdminRow {
  constructor(id, page) {
    this.id = id;
    this.page = page;
    this.entry = null;
    this.keysKey = null;
    this.name = el('span', { class: 'tenant-name' });
    this.keys = el('ul', { class: 'key-list' });
    this.error = el('p', { class: 'error tenant-admin-error', attrs: { role: 'alert' } });
    const button = (cls, text, action) => el('button', { class: cls, attrs: { type: 'button' }, text, on: { click: () => this.run(action) } });
    this.root = el(
      'tr',
      { attrs: { 'data-tenant': id } },
      cell(this.name),
      cell(this.keys),
      el(
        'td',
        { class: 'tenant-actions' },
        el(
          'div',
          { class: 'row' },
          el('button', { class: 'edit-tenant', attrs: { type: 'button' }, text: 'Edit', on: { click: () => this.page.form.edit(this.entry) } }),
          button('new-key', 'New key', () => this.mint()),
          button('delete-tenant', 'Delete tenant', () => this.delete()),
        ),
        this.error,
      ),
    );
  }

  update(entry) {
    this.entry = entry;
    append(clear(this.name), el('strong', { text: entry.id }), entry.admin ? el('span', { class: 'pill admin', text: 'admin' }) : null);
    const ids = entry.keys.map((k) => String(k.id));
    const key = JSON.stringify(ids);
    if (key === this.keysKey) return; // a Revoke being clicked keeps its button
    this.keysKey = key;
    clear(this.keys);
    if (!ids.length) this.keys.appendChild(el('li', { class: 'muted no-keys', text: 'no keys yet' }));
    for (const keyId of ids) {
      this.keys.appendChild(
        el(
          'li',
          { attrs: { 'data-key': keyId } },
          el('code', { text: keyId }),
          el('button', { class: 'revoke-key link', attrs: { type: 'button', 'data-key': keyId }, text: 'Revoke', on: { click: () => this.run(() => this.revoke(keyId)) } }),
        ),
      );
    }
  }

  async mint() {
    const response = await this.page.ctx.api(adminPath(this.id, 'keys'), { method: 'POST' });
    if (!response.ok) {
      this.error.textContent = await errorMessage(response);
      return;
    }
    this.page.keyBox.show(await response.json());
    this.page.refresh();
  }

  async revoke(keyId) {
    if (!window.confirm(`Revoke the key ${keyId} of the tenant "${this.id}"? Requests with it will be refused (401).`)) return;
    const response = await this.page.ctx.api(adminPath(this.id, 'keys', keyId), { method: 'DELETE' });
    if (!response.ok) this.error.textContent = await errorMessage(response);
    else this.page.refresh();
  }

  async delete() {
    const keys = this.entry ? this.entry.keys.length : 0;
    if (!window.confirm(`Delete the tenant "${this.id}" and its ${keys} key(s)? Requests with them will be refused (401).`)) return;
    const response = await this.page.ctx.api(adminPath(this.id), { method: 'DELETE' });
    if (!response.ok) this.error.textContent = await errorMessage(response);
    else this.page.refresh();
  }

  /** An action, the row's buttons disabled meanwhile; a network failure shown as text. */
  async run(action) {
    this.error.textContent = '';
    const buttons = () => [...this.root.querySelectorAll('button')];
    buttons().forEach((b) => (b.disabled = true));
    try {
      await action();
    } catch (error) {
      this.error.textContent = error.message || String(error);
    } finally {
      buttons().forEach((b) => (b.disabled = false));
    }
  }
}

/** The form that creates a tenant, or edits one (Edit: prefilled, its id fixed). */
class TenantForm {
  constructor(page) {
    this.page = page;
    this.editing = null; // the id of the tenant edited; null: a new tenant
    this.title = el('h3', { attrs: { id: 'tenant-form-title' }, text: 'New tenant' });
    this.id = el('input', { attrs: { id: 'tenant-form-id', name: 'id', type: 'text', autocomplete: 'off', placeholder: 'e.g. acme', maxlength: '128' } });
    this.faces = new Map(
      FACES.map((face) => [face, el('input', { class: 'tenant-face', attrs: { type: 'checkbox', id: `tenant-form-face-${face}`, 'data-face': face } })]),
    );
    this.models = el('input', { attrs: { id: 'tenant-form-models', name: 'models', type: 'text', autocomplete: 'off', placeholder: 'empty: every model' } });
    this.weight = el('input', { attrs: { id: 'tenant-form-weight', name: 'weight', type: 'number', step: 'any', value: '1' } });
    this.limits = new Map(
      LIMITS.map(([name]) => [name, el('input', { class: 'limit-input', attrs: { id: `tenant-form-${name}`, name, type: 'number', step: '1', min: '1', placeholder: 'unlimited', 'data-limit': name } })]),
    );
    this.save = el('button', { class: 'primary', attrs: { type: 'submit', id: 'tenant-form-save' }, text: 'Create tenant' });
    this.cancel = el('button', { attrs: { type: 'button', id: 'tenant-form-cancel' }, text: 'Clear', on: { click: () => this.startNew() } });
    this.error = el('p', { class: 'error', attrs: { id: 'tenant-form-error', role: 'alert' } });
    this.done = el('span', { class: 'muted small', attrs: { id: 'tenant-form-done', role: 'status' } });
    const field = (input, label) => el('div', { class: 'field' }, el('label', { attrs: { for: input.id }, text: label }), input);
    this.root = el(
      'section',
      { class: 'panel tenant-form', attrs: { id: 'tenant-form-panel', 'aria-labelledby': 'tenant-form-title' } },
      this.title,
      el(
        'form',
        { attrs: { id: 'tenant-form', novalidate: true }, on: { submit: (event) => this.submit(event) } },
        el(
          'div',
          { class: 'tenant-form-grid' },
          field(this.id, 'Tenant id'),
          el(
            'fieldset',
            { class: 'faces' },
            el('legend', { text: 'Faces' }),
            ...FACES.map((face) => el('label', { class: 'face', attrs: { for: `tenant-form-face-${face}` } }, this.faces.get(face), face)),
          ),
          field(this.models, 'Models (comma-separated; empty: all)'),
          field(this.weight, 'Weight (fair scheduling)'),
          ...LIMITS.map(([name, label]) => field(this.limits.get(name), `${label} (empty: unlimited)`)),
        ),
        el('div', { class: 'row' }, this.save, this.cancel, this.done),
        this.error,
      ),
    );
    this.startNew();
  }

  /** Back to a new tenant's empty form (the default faces, weight 1, no limits). */
  startNew() {
    this.editing = null;
    this.title.textContent = 'New tenant';
    this.id.readOnly = false;
    this.id.value = '';
    for (const [face, box] of this.faces) box.checked = DEFAULT_FACES.includes(face);
    this.models.value = '';
    this.weight.value = '1';
    for (const input of this.limits.values()) input.value = '';
    this.save.textContent = 'Create tenant';
    this.cancel.textContent = 'Clear';
    this.error.textContent = '';
  }

  /** The form prefilled with a tenant's settings (the admin API's entry). */
  edit(entry) {
    if (!entry) return;
    this.editing = entry.id;
    this.title.textContent = `Edit tenant ${entry.id}`;
    this.id.value = entry.id;
    this.id.readOnly = true;
    const faces = new Set(entry.faces);
    for (const [face, box] of this.faces) box.checked = faces.has(face);
    this.models.value = entry.models === null ? '' : entry.models.join(', ');
    this.weight.value = String(entry.weight);
    for (const [name, input] of this.limits) {
      const value = entry.limits[name];
      input.value = value === null || value === undefined ? '' : String(value);
    }
    this.save.textContent = 'Save tenant';
    this.cancel.textContent = 'Cancel';
    this.error.textContent = '';
    this.done.textContent = '';
    this.root.scrollIntoView({ block: 'nearest' });
    this.models.focus();
  }

  /** The tenants now: a tenant being edited that was deleted meanwhile is said so. */
  known(ids) {
    if (this.editing !== null && !ids.has(this.editing)) {
      this.error.textContent = `The tenant ${this.editing} was deleted meanwhile: saving creates it again.`;
    }
  }

  async submit(event) {
    event.preventDefault();
    this.error.textContent = '';
    this.done.textContent = '';
    const editing = this.editing;
    const id = editing ?? this.id.value.trim();
    if (!id) {
      this.error.textContent = 'Give the tenant an id.';
      return;
    }
    if (editing === null && this.page.ids.has(id)) {
      this.error.textContent = `A tenant ${id} exists already: change it with its Edit button.`;
      return;
    }
    const limits = Object.fromEntries([...this.limits].map(([name, input]) => [name, input.value]));
    const faces = FACES.filter((face) => this.faces.get(face).checked);
    const { body, error } = tenantSettings({ faces, models: this.models.value, weight: this.weight.value, limits });
    if (error) {
      this.error.textContent = error;
      return;
    }
    this.save.disabled = true;
    try {
      const response = await this.page.ctx.api(adminPath(id), {
        method: 'PUT',
        headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify(body),
      });
      if (!response.ok) {
        this.error.textContent = await errorMessage(response);
        return;
      }
      this.startNew();
      this.done.textContent = response.status === 201 ? `Tenant ${id} created: give it a key with its New key button.` : `Tenant ${id} saved.`;
      this.page.refresh();
    } catch (e) {
      this.error.textContent = e.message || String(e);
    } finally {
      this.save.disabled = false;
    }
  }
}

/** The changes' part of the page: the tenants' rows (keys, actions) and the form. */
class TenantAdmin {
  constructor(ctx, refresh) {
    this.ctx = ctx;
    this.refresh = refresh;
    this.ids = new Set();
    this.rows = new Map(); // id -> TenantAdminRow
    this.unavailable = false; // the 409: no keys file, nothing to manage (not asked again)
    this.keyBox = new KeyBox();
    this.form = new TenantForm(this);
    this.body = el('tbody');
    this.error = el('p', { class: 'error', attrs: { id: 'tenant-admin-error', role: 'alert' } });
    const head = el('thead', {}, el('tr', {}, ...['Tenant', 'API keys', ''].map((label) => el('th', { text: label }))));
    this.controls = el(
      'div',
      { attrs: { id: 'tenant-admin-controls' } },
      el('div', { class: 'table-box' }, el('table', { class: 'table data-table', attrs: { id: 'tenant-admin-table' } }, head, this.body)),
      this.form.root,
    );
    this.root = el(
      'section',
      { class: 'tenant-admin', attrs: { id: 'tenant-admin', 'aria-label': 'Manage tenants and keys', hidden: true } },
      el('div', { class: 'row page-head' }, el('h3', { text: 'Manage tenants and keys' }), el('span', { class: 'muted', text: 'changes go to the keys file and apply at once' })),
      this.error,
      this.controls,
    );
  }

  /** GET /admin/tenants, the rows updated (a 409 shown instead, once). */
  async load() {
    if (this.unavailable) return;
    let response;
    try {
      response = await this.ctx.api('/admin/tenants');
      if (response.status === 409) {
        this.unavailable = true;
        this.controls.remove();
        this.error.remove();
        this.root.appendChild(el('p', { class: 'notice', attrs: { id: 'tenant-admin-unavailable' }, text: await errorMessage(response) }));
        this.root.hidden = false;
        return;
      }
      if (!response.ok) throw new Error(await errorMessage(response));
      this.render((await response.json()).data || []);
      this.error.textContent = '';
    } catch (e) {
      this.error.textContent = `Tenants cannot be changed now: ${e.message || e}`;
    }
    this.root.hidden = false;
  }

  render(tenants) {
    this.ids = new Set(tenants.map((t) => String(t.id)));
    for (const [id, row] of this.rows) {
      if (!this.ids.has(id)) {
        row.root.remove();
        this.rows.delete(id);
      }
    }
    tenants.forEach((tenant, i) => {
      const id = String(tenant.id);
      let row = this.rows.get(id);
      if (!row) {
        row = new TenantAdminRow(id, this);
        this.rows.set(id, row);
      }
      if (this.body.children[i] !== row.root) this.body.insertBefore(row.root, this.body.children[i] || null);
      row.update(tenant);
    });
    this.form.known(this.ids);
  }

  /** The tenants list failed (a refusal): nothing of it stays shown; a minted key's box does. */
  hide() {
    this.root.hidden = true;
  }
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
  const admin = new TenantAdmin(ctx, () => poller.now()); // admin.keyBox: a minted key, once
  root.append(
    el('div', { class: 'row page-head' }, el('h2', { text: 'Tenants and usage' }), el('span', { class: 'muted', text: 'usage since midnight UTC' })),
    status,
    error,
    admin.keyBox.root,
    tenantsBox,
    admin.root,
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
      await admin.load();
      await renderWeek(data);
    },
    REFRESH_MS,
    (e) => {
      error.textContent = e.message || String(e);
      status.textContent = '';
      clear(tenantsBox); // nothing stale under a refusal
      clear(othersBox);
      admin.hide();
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
