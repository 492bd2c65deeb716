// Rollouts (an admin key's page): each rollout of /admin/rollouts with its targets (a
// share bar: CSS segments whose widths are classes, console.css's .share-seg.w0 ... .w100
// in steps of 5, since the CSP allows no inline style), weights, pinned tenants, rollback
// policy and automatic rollbacks. A target's weight is changed and saved (PUT with the
// full targets list, tenants and rollback policy kept), a rollout rolled back to one
// target, deleted (after confirm()), or created from the served models (/v1/models less
// the rollouts). Refreshed every 5 s while the tab is shown and the browser tab visible;
// a weight being edited is not overwritten. Rollout, model and tenant names are the
// server's strings: rendered as text only.
import { el, clear, errorMessage } from './dom.js';
import { cell, count, poll, useStylesheet, when } from './console-data.js';

const REFRESH_MS = 5000;
const COLORS = 6; // console.css: .share-seg.c0 ... .c5 (the .swatch colours)
const SEGMENT_STEP = 5; // .share-seg.w0, .w5, ... .w100: percent of the bar

function path(name) {
  return `/admin/rollouts/${encodeURIComponent(name)}`;
}

/** 0.9 -> "90 %", 1/3 -> "33.3 %". */
export function percent(share) {
  if (share === null || share === undefined || !Number.isFinite(share)) return '–';
  return `${Math.round(share * 1000) / 10} %`;
}

/** A share's width class: the nearest 5 %, a share above 0 at least 5 %. */
export function widthClass(share) {
  const steps = 100 / SEGMENT_STEP;
  let step = Math.round((Number(share) || 0) * steps);
  if (share > 0 && step === 0) step = 1;
  return `w${Math.min(steps, Math.max(0, step)) * SEGMENT_STEP}`;
}

function policyText(policy) {
  if (!policy) return 'Automatic rollback: off.';
  return (
    `Automatic rollback: a target failing ${percent(policy.max_error_rate)} or more of its last ` +
    `${count(policy.window)} requests (${count(policy.min_requests)} at least) is taken out.`
  );
}

/** The share bar: a segment per target serving by weight, its share in its title. */
function shareBar(rollout) {
  const label = rollout.targets.map((t) => `${t.model}: ${percent(t.share)}`).join(', ');
  return el(
    'div',
    { class: 'share-bar', attrs: { role: 'img', 'aria-label': `shares: ${label}` } },
    ...rollout.targets.map((t, i) =>
      t.share > 0
        ? el('span', {
            class: `share-seg c${i % COLORS} ${widthClass(t.share)}`,
            attrs: { title: `${t.model}: ${percent(t.share)}`, 'data-model': t.model, 'data-share': String(t.share) },
          })
        : null,
    ),
  );
}

function tenantsList(tenants) {
  if (!tenants.length) return el('span', { class: 'muted', text: 'none' });
  return el('span', {}, ...tenants.map((t) => el('span', { class: 'pill tenant', text: t })));
}

function rolledBackBox(rollout) {
  if (!rollout.rolled_back.length) {
    return el('p', { class: 'muted small rolled-back-none', text: 'No automatic rollback.' });
  }
  const body = el('tbody');
  const columns = [['When'], ['Target'], ['Error rate', 'num'], ['Requests', 'num']];
  const node = el(
    'table',
    { class: 'table data-table rolled-back' },
    el('thead', {}, el('tr', {}, ...columns.map(([label, num]) => el('th', { class: num || null, text: label })))),
    body,
  );
  for (const r of [...rollout.rolled_back].reverse()) {
    body.appendChild(
      el(
        'tr',
        { attrs: { 'data-target': r.target } },
        cell(when(r.at)),
        cell(r.target),
        cell(percent(r.error_rate), { num: true }),
        cell(count(r.requests), { num: true }),
      ),
    );
  }
  return node;
}

/** One rollout's card: built once, its parts updated on each refresh (see update). */
class RolloutCard {
  constructor(name, page) {
    this.name = name;
    this.page = page;
    this.rollout = null;
    this.drafts = new Map(); // model -> the weight typed, not saved yet
    this.inputs = new Map(); // model -> its weight input
    this.targetsKey = '';
    this.title = el('h3', { class: 'rollout-name', text: name });
    this.policy = el('p', { class: 'muted small rollout-policy' });
    this.bar = el('div', { class: 'share-bar-box' });
    this.body = el('tbody');
    this.error = el('p', { class: 'error rollout-error', attrs: { role: 'alert' } });
    this.save = el('button', { class: 'primary save-weights', attrs: { type: 'submit', disabled: true }, text: 'Save weights' });
    this.reset = el('button', {
      class: 'reset-weights',
      attrs: { type: 'button', disabled: true },
      text: 'Discard changes',
      on: { click: () => this.discard() },
    });
    this.remove = el('button', { class: 'delete-rollout', attrs: { type: 'button' }, text: 'Delete', on: { click: () => this.delete() } });
    this.history = el('div', { class: 'rolled-back-box' });
    const head = el('thead', {}, el('tr', {}, ...['', 'Target', 'Share', 'Weight', 'Pinned tenants', 'Recent failures', ''].map((label, i) => el('th', { class: i === 2 || i === 3 || i === 5 ? 'num' : null, text: label }))));
    this.form = el(
      'form',
      { class: 'rollout-form', attrs: { novalidate: true }, on: { submit: (event) => this.submit(event) } },
      el('div', { class: 'table-box' }, el('table', { class: 'table data-table rollout-targets' }, head, this.body)),
      el('div', { class: 'row' }, this.save, this.reset, el('span', { class: 'spacer' }), this.remove),
    );
    this.root = el(
      'section',
      { class: 'panel rollout', attrs: { 'data-rollout': name } },
      el('div', { class: 'row page-head' }, this.title),
      this.bar,
      this.form,
      this.error,
      this.policy,
      el('h4', { text: 'Automatic rollbacks' }),
      this.history,
    );
  }

  /** The server's rollout: the bar, policy and history redrawn; the targets' rows updated in
   * place where the targets are the same (an input being edited keeps its value and focus). */
  update(rollout) {
    this.rollout = rollout;
    clear(this.bar).appendChild(shareBar(rollout));
    this.policy.textContent = policyText(rollout.rollback);
    clear(this.history).appendChild(rolledBackBox(rollout));
    const key = JSON.stringify(rollout.targets.map((t) => t.model));
    if (key !== this.targetsKey) this.rebuild(rollout, key);
    else rollout.targets.forEach((t, i) => this.fill(this.body.rows[i], t, i));
    for (const model of [...this.drafts.keys()]) if (!this.inputs.has(model)) this.drafts.delete(model);
    this.dirty();
  }

  rebuild(rollout, key) {
    const active = document.activeElement;
    const focused = active && this.body.contains(active) && active.classList.contains('weight-input') ? active.dataset.model : null;
    clear(this.body);
    this.inputs.clear();
    this.targetsKey = key;
    rollout.targets.forEach((t, i) => {
      const input = el('input', {
        class: 'weight-input',
        attrs: { type: 'number', min: '0', step: 'any', 'data-model': t.model, 'aria-label': `weight of ${t.model}` },
        on: { input: () => this.edited(t.model, input.value) },
      });
      this.inputs.set(t.model, input);
      const back = el('button', {
        class: 'rollback-to',
        attrs: { type: 'button', 'data-model': t.model },
        text: `Roll back to ${t.model}`,
        on: { click: () => this.rollBackTo(t.model) },
      });
      const row = el(
        'tr',
        { attrs: { 'data-model': t.model } },
        cell(el('span', { class: `swatch c${i % COLORS}` })),
        cell(el('strong', { text: t.model })),
        cell('', { num: true }),
        cell(input, { num: true }),
        cell(''),
        cell('', { num: true }),
        cell(back),
      );
      row.cells[2].classList.add('share');
      row.cells[4].classList.add('tenants');
      row.cells[5].classList.add('recent');
      this.body.appendChild(row);
      this.fill(row, t, i);
    });
    if (focused !== null && this.inputs.has(focused)) this.inputs.get(focused).focus();
  }

  /** A target's row from the server's values; its weight input left alone while edited. */
  fill(row, target, i) {
    const share = row.cells[2];
    share.textContent = percent(target.share);
    share.dataset.share = String(target.share);
    clear(row.cells[4]).appendChild(tenantsList(target.tenants));
    // This server's latest requests to the target, as the rollback policy counts failures.
    const recent = target.recent || { requests: 0, failed: 0, error_rate: null };
    row.cells[5].textContent = recent.requests ? `${recent.failed} of ${recent.requests} (${percent(recent.error_rate)})` : '–';
    row.cells[5].title = 'failed (5xx, engine errors) of the latest requests sent to it on this server';
    const input = this.inputs.get(target.model);
    input.dataset.weight = String(target.weight);
    const editing = this.drafts.has(target.model) || document.activeElement === input;
    if (!editing) input.value = String(target.weight);
    const back = row.cells[6].firstChild;
    const others = this.rollout.targets.filter((t, j) => j !== i);
    const already = target.weight > 0 && others.every((t) => t.weight === 0);
    back.disabled = already;
    back.title = already ? `every request not pinned to a tenant goes to ${target.model} already` : `weight 1 for ${target.model}, 0 for the others (pinned tenants kept)`;
  }

  edited(model, value) {
    const input = this.inputs.get(model);
    if (value === input.dataset.weight) this.drafts.delete(model);
    else this.drafts.set(model, value);
    this.dirty();
  }

  dirty() {
    const changed = this.drafts.size > 0;
    this.save.disabled = !changed;
    this.reset.disabled = !changed;
    for (const [model, input] of this.inputs) input.classList.toggle('changed', this.drafts.has(model));
  }

  discard() {
    this.drafts.clear();
    for (const t of this.rollout.targets) this.inputs.get(t.model).value = String(t.weight);
    this.error.textContent = '';
    this.dirty();
  }

  /** PUT the rollout with `targets` (its tenants and rollback policy kept). */
  async put(targets) {
    this.error.textContent = '';
    const body = {
      targets: targets.map((t) => ({ model: t.model, weight: t.weight, tenants: t.tenants })),
      rollback: this.rollout.rollback,
    };
    const response = await this.page.ctx.api(path(this.name), {
      method: 'PUT',
      headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify(body),
    });
    if (!response.ok) {
      this.error.textContent = await errorMessage(response);
      return false;
    }
    this.drafts.clear();
    // The answer at once (its automatic rollbacks are the list's: kept until the refresh).
    const saved = await response.json();
    this.rollout = { ...saved, rolled_back: this.rollout.rolled_back };
    this.page.refresh();
    return true;
  }

  async submit(event) {
    event.preventDefault();
    const targets = [];
    for (const t of this.rollout.targets) {
      const text = this.drafts.has(t.model) ? this.drafts.get(t.model) : String(t.weight);
      if (text.trim() === '' || !Number.isFinite(Number(text))) {
        this.error.textContent = `The weight of ${t.model} is not a number.`;
        return;
      }
      targets.push({ ...t, weight: Number(text) });
    }
    await this.run(() => this.put(targets));
  }

  async rollBackTo(model) {
    const targets = this.rollout.targets.map((t) => ({ ...t, weight: t.model === model ? 1 : 0 }));
    await this.run(() => this.put(targets));
  }

  async delete() {
    if (!window.confirm(`Delete the rollout "${this.name}"? Requests for it will be refused (404).`)) return;
    await this.run(async () => {
      this.error.textContent = '';
      const response = await this.page.ctx.api(path(this.name), { method: 'DELETE' });
      if (!response.ok) this.error.textContent = await errorMessage(response);
      else this.page.refresh();
    });
  }

  /** An action, its buttons disabled meanwhile; a network failure shown as text. */
  async run(action) {
    const buttons = [...this.root.querySelectorAll('button')];
    const before = buttons.map((b) => b.disabled);
    buttons.forEach((b) => (b.disabled = true));
    try {
      await action();
    } catch (error) {
      this.error.textContent = error.message || String(error);
    } finally {
      buttons.forEach((b, i) => (b.disabled = before[i]));
      if (this.rollout) this.update(this.rollout);
    }
  }
}

/** The form that creates a rollout: a name, and served models each with a weight. */
class CreateForm {
  constructor(page) {
    this.page = page;
    this.models = [];
    this.rows = new Map(); // model -> {check, weight}
    this.name = el('input', { attrs: { id: 'rollout-new-name', name: 'name', type: 'text', autocomplete: 'off', placeholder: 'e.g. summarizer', required: true } });
    this.list = el('div', { class: 'rollout-new-models', attrs: { id: 'rollout-new-models' } });
    this.error = el('p', { class: 'error', attrs: { id: 'rollout-create-error', role: 'alert' } });
    this.button = el('button', { class: 'primary', attrs: { type: 'submit', id: 'rollout-create' }, text: 'Create rollout' });
    this.root = el(
      'section',
      { class: 'panel rollout-new', attrs: { id: 'rollout-new', 'aria-label': 'New rollout' } },
      el('h3', { text: 'New rollout' }),
      el(
        'form',
        { attrs: { id: 'rollout-new-form', novalidate: true }, on: { submit: (event) => this.submit(event) } },
        el('div', { class: 'stack' }, el('label', { attrs: { for: 'rollout-new-name' }, text: 'Name (the model name clients ask for)' }), this.name),
        el('p', { class: 'muted small', text: 'Targets: served models (tick each, with its weight; the shares are the weights over their sum).' }),
        this.list,
        el('div', { class: 'row' }, this.button),
        this.error,
      ),
    );
  }

  /** The served models less the rollouts; rows kept (ticks and weights typed) by model. */
  setModels(models) {
    const key = JSON.stringify(models);
    if (key === JSON.stringify(this.models)) return;
    this.models = models;
    const kept = this.rows;
    this.rows = new Map();
    clear(this.list);
    if (!models.length) {
      this.list.appendChild(el('p', { class: 'muted', text: 'No served model to target.' }));
      return;
    }
    models.forEach((model, i) => {
      const old = kept.get(model);
      const id = `rollout-new-model-${i}`;
      const check = old ? old.check : el('input', { class: 'target-check', attrs: { type: 'checkbox', id, 'data-model': model } });
      const weight =
        old ? old.weight : el('input', { class: 'weight-input target-weight', attrs: { type: 'number', min: '0', step: 'any', value: '1', 'data-model': model, 'aria-label': `weight of ${model}` } });
      check.id = id;
      this.rows.set(model, { check, weight });
      this.list.appendChild(
        el('div', { class: 'row rollout-new-target', attrs: { 'data-model': model } }, check, el('label', { class: 'target-name', attrs: { for: id }, text: model }), weight),
      );
    });
  }

  async submit(event) {
    event.preventDefault();
    this.error.textContent = '';
    const name = this.name.value.trim();
    if (!name) {
      this.error.textContent = 'Give the rollout a name.';
      return;
    }
    if (this.page.names.has(name)) {
      this.error.textContent = `A rollout named ${name} exists already: change its weights above.`;
      return;
    }
    const targets = [];
    for (const [model, { check, weight }] of this.rows) {
      if (!check.checked) continue;
      if (weight.value.trim() === '' || !Number.isFinite(Number(weight.value))) {
        this.error.textContent = `The weight of ${model} is not a number.`;
        return;
      }
      targets.push({ model, weight: Number(weight.value) });
    }
    if (!targets.length) {
      this.error.textContent = 'Tick at least one target model.';
      return;
    }
    this.button.disabled = true;
    try {
      const response = await this.page.ctx.api(path(name), {
        method: 'PUT',
        headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify({ targets }),
      });
      if (!response.ok) {
        this.error.textContent = await errorMessage(response);
        return;
      }
      this.name.value = '';
      for (const { check, weight } of this.rows.values()) {
        check.checked = false;
        weight.value = '1';
      }
      this.page.refresh();
    } catch (error) {
      this.error.textContent = error.message || String(error);
    } finally {
      this.button.disabled = false;
    }
  }
}

export function mount(root, ctx) {
  useStylesheet();
  const status = el('p', { class: 'status-line', attrs: { id: 'rollouts-status' }, text: 'Loading…' });
  const error = el('p', { class: 'error', attrs: { id: 'rollouts-error', role: 'alert' } });
  const list = el('div', { class: 'rollouts stack', attrs: { id: 'rollouts-list' } });
  const cards = new Map(); // name -> RolloutCard
  let load = () => {}; // the poller's now(), once it runs
  const page = { ctx, names: new Set(), refresh: () => load() };
  const form = new CreateForm(page);
  form.root.hidden = true;
  root.append(
    el('div', { class: 'row page-head' }, el('h2', { text: 'Rollouts' }), el('span', { class: 'muted', text: 'a model name split between served models by weight and tenant' })),
    status,
    error,
    list,
    form.root,
  );

  const render = (data, models) => {
    const rollouts = data.data || [];
    page.names = new Set(rollouts.map((r) => r.name));
    for (const [name, card] of cards) {
      if (!page.names.has(name)) {
        card.root.remove();
        cards.delete(name);
      }
    }
    rollouts.forEach((rollout, i) => {
      let card = cards.get(rollout.name);
      if (!card) {
        card = new RolloutCard(rollout.name, page);
        cards.set(rollout.name, card);
      }
      if (list.children[i] !== card.root) list.insertBefore(card.root, list.children[i] || null);
      card.update(rollout);
    });
    const empty = list.querySelector('#rollouts-empty');
    if (!rollouts.length && !empty) list.appendChild(el('p', { class: 'notice', attrs: { id: 'rollouts-empty' }, text: 'No rollout yet: create one below, or start the server with --model-rollout.' }));
    if (rollouts.length && empty) empty.remove();
    if (models) form.setModels(models.filter((m) => !page.names.has(m)));
    form.root.hidden = false;
    status.textContent = `${rollouts.length} rollout(s) · updated ${new Date().toLocaleTimeString([], { hour12: false })}`;
  };

  const tick = async () => {
    const data = await ctx.json('/admin/rollouts');
    let models = null;
    try {
      models = ((await ctx.json('/v1/models')).data || []).filter((m) => m.task !== 'embed').map((m) => String(m.id));
    } catch (e) {
      form.error.textContent = `The served models are not available: ${e.message || e}`; // the form keeps those it has
    }
    if (stopped) return;
    error.textContent = '';
    render(data, models);
  };

  const failed = (e) => {
    error.textContent = e.message || String(e);
    status.textContent = '';
    for (const card of cards.values()) card.root.remove(); // nothing stale under a refusal
    cards.clear();
    clear(list);
    form.root.hidden = true;
  };

  // One load at a time, every REFRESH_MS after the last, while the browser tab is visible;
  // a load asked for during another (after a change) runs as soon as that one ends.
  let stopped = false;
  const poller = poll(tick, REFRESH_MS, (e) => {
    if (!stopped) failed(e);
  });
  load = () => poller.now();
  return {
    unmount() {
      stopped = true;
      poller.stop();
    },
  };
}
