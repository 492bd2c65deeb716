// Tenants and usage (an admin key's page): each tenant of the keys file with its faces,
// models and limits, and its usage today (UTC): requests, tokens, 429s; refreshed every 5 s.
// Tenant ids and model names are the server's strings: rendered as text only.
import { el, clear } from './dom.js';
import { cell, count, poll, table, useStylesheet, when } from './console-data.js';

const REFRESH_MS = 5000;
const LIMITS = [
  ['requests_per_second', 'req/s'],
  ['requests_per_minute', 'req/min'],
  ['tokens_per_minute', 'tokens/min'],
  ['max_concurrent_streams', 'streams'],
];
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

export function mount(root, ctx) {
  useStylesheet();
  const status = el('p', { class: 'status-line', attrs: { id: 'tenants-status' }, text: 'Loading…' });
  const error = el('p', { class: 'error', attrs: { id: 'tenants-error', role: 'alert' } });
  const tenantsBox = el('div', { class: 'table-box' });
  const othersBox = el('div', { class: 'table-box' });
  root.append(
    el('div', { class: 'row page-head' }, el('h2', { text: 'Tenants and usage' }), el('span', { class: 'muted', text: 'usage since midnight UTC' })),
    status,
    error,
    tenantsBox,
    othersBox,
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

  const poller = poll(
    async () => {
      const data = await ctx.json('/ui/api/tenants');
      error.textContent = '';
      render(data);
    },
    REFRESH_MS,
    (e) => {
      error.textContent = e.message || String(e);
      status.textContent = '';
      clear(tenantsBox); // nothing stale under a refusal
      clear(othersBox);
    },
  );
  return {
    unmount() {
      poller.stop();
    },
  };
}
