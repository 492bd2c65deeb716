// Training: the Tinker training runs, a run's loss / metric curve per step (gaining points
// as its results come: polled every 2 s), and its checkpoints, a sampler checkpoint
// sampled in the playground with one click. Run ids, model names, metric names and
// checkpoint paths are the server's strings: rendered as text only.
import { el, clear } from './dom.js';
import { LineChart } from './chart.js';
import { bytes, cell, count, metric, poll, relative, table, useStylesheet, when } from './console-data.js';

const RUN_MS = 2000;
const LIST_MS = 2000;
const MAX_POINTS = 10000;
const DEFAULT_METRIC = 'loss:sum';

function api(path) {
  return `/ui/api/training/${path}`;
}

/** The metric shown first: the loss if the run has one, else the first there is. */
function defaultMetric(names) {
  if (names.includes(DEFAULT_METRIC)) return DEFAULT_METRIC;
  return names.find((n) => n.startsWith('loss')) || names[0] || DEFAULT_METRIC;
}

function loraText(run) {
  const parts = [run.train_attn && 'attn', run.train_mlp && 'mlp', run.train_unembed && 'unembed'].filter(Boolean);
  return `rank ${run.lora_rank} (${parts.join(', ')})`;
}

/** One run's detail: its curve, polled while shown, and its checkpoints. */
class RunView {
  constructor(parent, ctx, runId, onError) {
    this.ctx = ctx;
    this.runId = runId;
    this.onError = onError;
    this.points = new Map(); // step -> point
    this.since = 0; // the first step not known complete
    this.metric = null;
    this.metricNames = [];
    this.chart = null;
    this.checkpointKey = '';
    this.head = el('div', { class: 'run-head' });
    this.picker = el('select', { attrs: { id: 'metric-select', 'aria-label': 'metric' }, on: { change: () => this.pick(this.picker.value) } });
    this.stepsText = el('span', { class: 'muted', attrs: { id: 'curve-steps' } });
    this.chartBox = el('div', { class: 'curve-box', attrs: { id: 'run-curve', 'data-points': '0' } });
    this.checkpointsBox = el('div', { class: 'table-box', attrs: { id: 'run-checkpoints' } });
    this.root = el(
      'div',
      { class: 'run-view stack', attrs: { 'data-run': runId } },
      this.head,
      el('div', { class: 'row' }, el('label', { attrs: { for: 'metric-select' }, text: 'Metric' }), this.picker, this.stepsText),
      this.chartBox,
      el('h3', { text: 'Checkpoints' }),
      this.checkpointsBox,
    );
    parent.appendChild(this.root);
    this.poller = poll(() => this.refresh(), RUN_MS, onError);
  }

  async refresh() {
    const data = await this.ctx.json(`${api('runs/')}${encodeURIComponent(this.runId)}?since=${this.since}`);
    this.renderHead(data.run);
    for (const point of data.points) this.points.set(point.step, point);
    let since = this.since;
    while (this.points.has(since) && this.points.get(since).done) since += 1;
    this.since = since;
    // Fewer points than asked for: the server keeps the last ones only.
    if (this.points.size > MAX_POINTS) {
      const steps = [...this.points.keys()].sort((a, b) => a - b);
      for (const step of steps.slice(0, this.points.size - MAX_POINTS)) this.points.delete(step);
    }
    this.updateMetrics();
    this.draw();
    this.renderCheckpoints(data.checkpoints);
  }

  renderHead(run) {
    clear(this.head);
    const state = run.loaded ? el('span', { class: 'pill live', text: 'loaded' }) : el('span', { class: 'pill', text: 'not loaded' });
    this.head.append(
      el('h3', { class: 'run-title' }, el('code', { text: run.id }), ' ', state),
      el(
        'p',
        { class: 'muted' },
        `base model ${run.base_model} · LoRA ${loraText(run)} · ${run.optimizer} · ${count(run.steps)} step(s) · last request ${relative(run.last_request_at)}`,
        run.owner ? ` · tenant ${run.owner}` : '',
      ),
    );
  }

  updateMetrics() {
    const names = new Set(this.metricNames);
    for (const point of this.points.values()) for (const name of Object.keys(point.metrics)) names.add(name);
    const sorted = [...names].sort();
    if (sorted.length !== this.metricNames.length) {
      this.metricNames = sorted;
      clear(this.picker);
      for (const name of sorted) this.picker.appendChild(el('option', { attrs: { value: name }, text: name }));
      if (!this.metric || !sorted.includes(this.metric)) this.metric = defaultMetric(sorted);
      this.picker.value = this.metric;
    }
  }

  pick(name) {
    this.metric = name;
    if (this.chart) this.chart.destroy();
    this.chart = null;
    this.draw();
  }

  draw() {
    const metricName = this.metric || DEFAULT_METRIC;
    if (!this.chart) {
      this.chart = new LineChart(this.chartBox, {
        title: metricName,
        series: [{ name: metricName }],
        maxPoints: MAX_POINTS,
        xFormat: (x) => `step ${x}`,
        yMin: null,
      });
    }
    const steps = [...this.points.keys()].sort((a, b) => a - b);
    const shown = steps.filter((s) => this.points.get(s).metrics[metricName] !== undefined);
    this.chart.setData(shown, [shown.map((s) => this.points.get(s).metrics[metricName])]);
    this.chartBox.setAttribute('data-points', String(shown.length));
    const last = shown.length ? this.points.get(shown[shown.length - 1]) : null;
    this.stepsText.textContent = last
      ? `${shown.length} point(s) · step ${last.step}: ${metric(last.metrics[metricName])}${last.done ? '' : ' (step in progress)'}`
      : 'no points yet: they come with the run\'s forward_backward results';
  }

  renderCheckpoints(checkpoints) {
    const key = JSON.stringify(checkpoints.map((c) => [c.path, c.public, c.expires_at, c.sampleable]));
    if (key === this.checkpointKey) return; // unchanged: keep the buttons as they are
    this.checkpointKey = key;
    clear(this.checkpointsBox);
    if (!checkpoints.length) {
      this.checkpointsBox.appendChild(el('p', { class: 'muted', text: 'No checkpoints saved yet.' }));
      return;
    }
    const { node, body } = table('checkpoints-table', [
      { label: 'Path' },
      { label: 'Kind' },
      { label: 'Size', num: true },
      { label: 'Created' },
      { label: 'Expires' },
      { label: 'Published' },
      { label: '' },
    ]);
    for (const c of checkpoints) {
      const expires = c.expires_at ? `${relative(c.expires_at)} (${when(c.expires_at)})` : 'never';
      body.appendChild(
        el(
          'tr',
          { attrs: { 'data-path': c.path } },
          cell(el('code', { text: c.path })),
          cell(c.kind),
          cell(bytes(c.size_bytes), { num: true, title: `${count(c.size_bytes)} bytes` }),
          cell(when(c.created_at)),
          cell(expires),
          cell(c.public ? 'yes' : 'no'),
          cell(this.sampleButton(c)),
        ),
      );
    }
    this.checkpointsBox.appendChild(node);
  }

  sampleButton(c) {
    if (!c.model) return el('span', { class: 'muted', text: 'training state' });
    const button = el('button', {
      class: 'primary sample-button',
      attrs: { type: 'button', disabled: !c.sampleable, title: c.sampleable ? `chat with ${c.model}` : c.not_sampleable_because },
      text: 'Sample in playground',
      on: { click: () => this.ctx.openPlayground({ model: c.model }) },
    });
    if (c.sampleable) return button;
    return el('span', { class: 'stack' }, button, el('span', { class: 'muted small', text: c.not_sampleable_because }));
  }

  destroy() {
    this.poller.stop();
    if (this.chart) this.chart.destroy();
    this.root.remove();
  }
}

export function mount(root, ctx) {
  useStylesheet();
  const error = el('p', { class: 'error', attrs: { id: 'training-error', role: 'alert' } });
  const status = el('p', { class: 'status-line', attrs: { id: 'training-status' }, text: 'Loading…' });
  const listBox = el('div', { class: 'table-box runs-box' });
  const detail = el('div', { class: 'run-detail' });
  root.append(
    el('div', { class: 'row page-head' }, el('h2', { text: 'Training runs' }), el('span', { class: 'muted', text: 'Tinker API' })),
    status,
    error,
    el('div', { class: 'training-layout' }, listBox, detail),
  );
  let view = null;
  let selected = null;

  const select = (runId) => {
    if (selected === runId) return;
    selected = runId;
    if (view) view.destroy();
    view = new RunView(detail, ctx, runId, (e) => {
      error.textContent = e.message || String(e);
    });
    for (const row of listBox.querySelectorAll('tr[data-run]')) row.classList.toggle('selected', row.dataset.run === runId);
  };

  const renderList = (data) => {
    clear(listBox);
    if (!data.enabled) {
      listBox.appendChild(el('p', { class: 'notice', attrs: { id: 'training-off' }, text: 'No Tinker API in this process: it is off (--no-tinker), or its runs live on the replicas (--replicas), which this page does not list yet.' }));
      status.textContent = '';
      return;
    }
    status.textContent = `${count(data.total)} run(s)${data.all ? '' : ' of your key'} · updated ${new Date().toLocaleTimeString([], { hour12: false })}`;
    if (!data.runs.length) {
      listBox.appendChild(
        el('p', { class: 'notice', attrs: { id: 'training-empty' }, text: 'No training runs yet: create one with the tinker SDK (see docs/tinker.md).' }),
      );
      return;
    }
    const { node, body } = table('runs-table', [
      { label: 'Run' },
      { label: 'Base model' },
      { label: 'Rank', num: true },
      { label: 'Steps', num: true },
      { label: 'Loss', num: true },
      { label: 'Last request' },
    ]);
    for (const run of data.runs) {
      const row = el(
        'tr',
        { class: run.id === selected ? 'clickable selected' : 'clickable', attrs: { 'data-run': run.id, tabindex: 0 }, on: { click: () => select(run.id), keydown: (e) => e.key === 'Enter' && select(run.id) } },
        cell(el('span', {}, el('code', { text: run.id }), run.loaded ? el('span', { class: 'pill live', text: 'loaded' }) : null)),
        cell(run.base_model),
        cell(String(run.lora_rank), { num: true }),
        cell(count(run.steps), { num: true }),
        cell(metric(run.last_metrics[DEFAULT_METRIC]), { num: true }),
        cell(relative(run.last_request_at)),
      );
      body.appendChild(row);
    }
    listBox.appendChild(node);
    if (!selected || !data.runs.some((r) => r.id === selected)) select(data.runs[0].id);
  };

  const poller = poll(
    async () => {
      const data = await ctx.json(api('runs'));
      error.textContent = '';
      renderList(data);
    },
    LIST_MS,
    (e) => {
      error.textContent = e.message || String(e);
    },
  );
  return {
    unmount() {
      poller.stop();
      if (view) view.destroy();
    },
  };
}
