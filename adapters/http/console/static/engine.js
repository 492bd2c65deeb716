// The engine view: counters and charts of the engine's last minutes, fed by the server-sent
// stream /ui/api/engine/events (one point per second: history first, then live). A fleet's
// replicas (infer serve --replicas N) come with every event: their load is tabled and
// charted per replica from the moment the page is open.
import { el, clear, fmt } from './dom.js';
import { LineChart } from './chart.js';

const MAX_REPLICA_SERIES = 6;

function counter(id, label) {
  const value = el('div', { class: 'value', attrs: { id: `engine-${id}` }, text: '–' });
  return { node: el('div', { class: 'card counter' }, el('div', { class: 'label', text: label }), value), value };
}

function mean(values) {
  const present = values.filter((v) => v !== null && v !== undefined);
  return present.length ? present.reduce((a, b) => a + b, 0) / present.length : null;
}

/** Seconds for people: under a second in ms. */
function seconds(value) {
  return value < 1 ? `${fmt(value * 1000)} ms` : `${fmt(value)} s`;
}

function pct(value) {
  return value === null || value === undefined ? null : value * 100;
}

export function mount(root, ctx) {
  const status = el('div', { class: 'status-line', attrs: { id: 'engine-status' }, text: 'connecting…' });
  const names = {
    running: 'Running',
    waiting: 'Waiting',
    kv: 'KV cache used',
    kvCached: 'KV cached (reusable)',
    hit: 'Prefix hit rate (1 min)',
    gen: 'Generated tokens/s (5 s)',
    prompt: 'Prompt tokens/s (5 s)',
    ttft: 'TTFT (1 min mean)',
    itl: 'Inter-token latency (1 min)',
  };
  const counters = Object.fromEntries(Object.entries(names).map(([id, label]) => [id, counter(id, label)]));
  const cards = el('div', { class: 'cards' }, ...Object.values(counters).map((c) => c.node));
  const grid = el('div', { class: 'grid' });
  const replicaBox = el('div', { class: 'replicas', attrs: { id: 'engine-replicas', hidden: true } });
  root.append(el('h2', { text: 'Engine' }), status, cards, grid, replicaBox);

  const charts = {
    requests: new LineChart(grid, { title: 'Requests', series: [{ name: 'running' }, { name: 'waiting' }] }),
    tokens: new LineChart(grid, { title: 'Throughput', unit: 'tokens/s', series: [{ name: 'generated' }, { name: 'prompt' }] }),
    kv: new LineChart(grid, { title: 'KV cache', unit: '%', series: [{ name: 'used' }, { name: 'cached' }] }),
    hit: new LineChart(grid, { title: 'Prefix cache hit rate', unit: '%', series: [{ name: 'hit rate' }] }),
    ttft: new LineChart(grid, { title: 'Time to first token', unit: 's', series: [{ name: 'mean' }, { name: 'max' }] }),
    itl: new LineChart(grid, { title: 'Inter-token latency', unit: 'ms', series: [{ name: 'mean' }] }),
  };
  const points = [];
  let windowS = 600;
  let engine = null;
  let local = true;

  const row = (p) => ({
    requests: [p.running, p.waiting],
    tokens: [p.generation_tps, p.prompt_tps],
    kv: [pct(p.kv_usage), pct(p.kv_cached)],
    hit: [pct(p.prefix_hit_rate)],
    ttft: [p.ttft_s, p.ttft_max_s],
    itl: [p.itl_s === null || p.itl_s === undefined ? null : p.itl_s * 1000],
  });

  function redrawAll() {
    const xs = points.map((p) => p.t);
    const rows = points.map(row);
    for (const [name, chart] of Object.entries(charts)) {
      const width = chart.series.length;
      chart.setData(xs, Array.from({ length: width }, (_, i) => rows.map((r) => r[name][i])));
    }
  }

  /** A fleet's second: its replicas' newest points summed (rates, counts) or averaged. */
  function fleetPoint(replicas) {
    const steps = replicas.map((r) => r.step).filter(Boolean);
    if (!steps.length) return null;
    const sum = (f) => replicas.reduce((a, r) => a + (r[f] ?? 0), 0);
    const sumStep = (f) => steps.reduce((a, p) => a + (p[f] ?? 0), 0);
    const queried = sumStep('prefix_queried');
    const ttfts = steps.map((p) => p.ttft_s).filter((v) => v !== null && v !== undefined);
    const maxes = steps.map((p) => p.ttft_max_s).filter((v) => v !== null && v !== undefined);
    const cached = steps.map((p) => p.kv_cached).filter((v) => v !== null && v !== undefined);
    return {
      t: Math.max(...steps.map((p) => p.t)),
      running: sum('running'),
      waiting: sum('waiting'),
      running_max: sum('running'),
      waiting_max: sum('waiting'),
      kv_usage: sum('kv_usage') / replicas.length,
      kv_cached: cached.length ? cached.reduce((a, b) => a + b, 0) / cached.length : null,
      prefix_queried: queried,
      prefix_hits: sumStep('prefix_hits'),
      prefix_hit_rate: queried ? sumStep('prefix_hits') / queried : null,
      generation_tps: sumStep('generation_tps'),
      prompt_tps: sumStep('prompt_tps'),
      ttft_s: mean(ttfts),
      ttft_max_s: maxes.length ? Math.max(...maxes) : null,
      itl_s: mean(steps.map((p) => p.itl_s)),
      finished: sumStep('finished'),
    };
  }

  function addPoint(p) {
    points.push(p);
    const r = row(p);
    for (const [name, chart] of Object.entries(charts)) chart.push(p.t, r[name]);
    const extra = points.length - windowS;
    if (extra > 0) points.splice(0, extra);
  }

  function updateCounters() {
    const last = points[points.length - 1];
    if (!last) return;
    const minute = points.slice(-60);
    const recent = points.slice(-5);
    const queried = minute.reduce((a, p) => a + p.prefix_queried, 0);
    const hits = minute.reduce((a, p) => a + p.prefix_hits, 0);
    const withTtft = minute.filter((p) => p.ttft_s !== null);
    counters.running.value.textContent = String(last.running);
    counters.waiting.value.textContent = String(last.waiting);
    counters.kv.value.textContent = `${fmt(last.kv_usage * 100)}%`;
    counters.kvCached.value.textContent = last.kv_cached === null ? 'n/a' : `${fmt(last.kv_cached * 100)}%`;
    counters.hit.value.textContent = queried ? `${fmt((hits / queried) * 100)}%` : '–';
    counters.gen.value.textContent = fmt(mean(recent.map((p) => p.generation_tps)));
    counters.prompt.value.textContent = fmt(mean(recent.map((p) => p.prompt_tps)));
    counters.ttft.value.textContent = withTtft.length ? seconds(mean(withTtft.map((p) => p.ttft_s))) : '–';
    const itl = mean(minute.map((p) => p.itl_s));
    counters.itl.value.textContent = itl === null ? '–' : `${fmt(itl * 1000)} ms`;
    if (engine && engine.kv_blocks) {
      counters.kv.value.setAttribute('title', `${Math.round(last.kv_usage * engine.kv_blocks)} of ${engine.kv_blocks} blocks`);
    }
  }

  // Replicas (a fleet): the latest table, and their load charted since the page opened.
  const replicaCharts = {};
  const replicaSeries = [];
  function showReplicas(replicas) {
    if (!replicas) return;
    replicaBox.hidden = false;
    clear(replicaBox);
    replicaBox.appendChild(el('h3', { text: `Replicas (${replicas.length})` }));
    replicaBox.appendChild(
      el('p', { class: 'muted', text: 'Each replica reports its load and its last second every second (as /admin/replicas lists them); the charts above sum the replicas since this page opened.' }),
    );
    const head = ['replica', 'state', 'node', 'pid', 'running', 'waiting', 'KV used', 'prefix hit rate', 'tokens/s'];
    const table = el(
      'table',
      { class: 'table', attrs: { id: 'engine-replica-table' } },
      el('thead', {}, el('tr', {}, ...head.map((h, i) => el('th', { class: i >= 4 ? 'num' : '', text: h })))),
      el(
        'tbody',
        {},
        ...replicas.map((r) =>
          el(
            'tr',
            {},
            el('td', {}, el('code', { text: String(r.id ?? '').slice(0, 12) })),
            el('td', { text: r.state ?? '' }),
            el('td', { text: r.node ?? '' }),
            el('td', { class: 'num', text: r.pid ?? '' }),
            el('td', { class: 'num', text: r.running ?? '' }),
            el('td', { class: 'num', text: r.waiting ?? '' }),
            el('td', { class: 'num', text: r.kv_usage === undefined ? '' : `${fmt(r.kv_usage * 100)}%` }),
            el('td', { class: 'num', text: r.prefix_hit_rate === undefined ? '' : `${fmt(r.prefix_hit_rate * 100)}%` }),
            el('td', { class: 'num', text: r.step ? fmt(r.step.generation_tps) : '–' }),
          ),
        ),
      ),
    );
    replicaBox.appendChild(table);
    const ids = replicas.map((r) => String(r.id)).slice(0, MAX_REPLICA_SERIES);
    if (ids.join() !== replicaSeries.join()) {
      replicaSeries.splice(0, replicaSeries.length, ...ids);
      for (const chart of Object.values(replicaCharts)) chart.destroy();
      const series = ids.map((id) => ({ name: id.slice(0, 8) }));
      replicaCharts.running = new LineChart(replicaGrid, { title: 'Running per replica', series });
      replicaCharts.kv = new LineChart(replicaGrid, { title: 'KV cache used per replica', unit: '%', series });
      replicaCharts.tokens = new LineChart(replicaGrid, { title: 'Generated per replica', unit: 'tokens/s', series });
    }
    replicaBox.appendChild(replicaGrid);
    const byId = Object.fromEntries(replicas.map((r) => [String(r.id), r]));
    const now = Date.now() / 1000;
    replicaCharts.running.push(now, ids.map((id) => byId[id]?.running ?? null));
    replicaCharts.kv.push(now, ids.map((id) => pct(byId[id]?.kv_usage)));
    replicaCharts.tokens.push(now, ids.map((id) => byId[id]?.step?.generation_tps ?? null));
  }
  const replicaGrid = el('div', { class: 'grid' });

  const stream = ctx.events(
    '/ui/api/engine/events',
    (event) => {
      if (event.type === 'history') {
        windowS = event.window_s || windowS;
        engine = event.engine || null;
        local = event.local !== false;
        points.splice(0, points.length, ...(local ? event.points || [] : []));
        const label = engine ? `${engine.model} · up to ${engine.max_num_seqs} running · ${engine.kv_blocks} KV blocks of ${engine.kv_block_size} tokens` : '';
        status.textContent = local
          ? `${label}${label ? ' · ' : ''}last ${Math.round(windowS / 60)} minutes, one point per second`
          : `${label}${label ? ' · ' : ''}engines on ${(event.replicas || []).length} replicas: charted since this page opened, one point per second`;
        redrawAll();
      } else if (event.type === 'update' && local) {
        for (const p of event.points || []) addPoint(p);
      }
      if (!local && event.replicas) {
        const p = fleetPoint(event.replicas);
        if (p && (!points.length || p.t > points[points.length - 1].t)) addPoint(p);
      }
      updateCounters();
      showReplicas(event.replicas);
    },
    {
      onError: (error) => {
        status.textContent = `disconnected (${error.message || error}); retrying…`;
      },
    },
  );

  return {
    unmount() {
      stream.close();
      for (const chart of [...Object.values(charts), ...Object.values(replicaCharts)]) chart.destroy();
    },
  };
}
