// A small line chart on a <canvas>: no library, no inline styles (sized by CSS classes and
// the canvas's own width / height attributes). Series names are drawn as text only.
import { el, fmt } from './dom.js';

// The series' colors, in order (console.css's .swatch.c0 ... .c5 match them).
export const COLORS = ['#4e79a7', '#f28e2b', '#59a14f', '#e15759', '#76b7b2', '#b07aa1'];

/** `x` as a label: wall-clock seconds (epoch) as HH:MM:SS, anything else as a number. */
function xLabel(x) {
  if (x > 1e9) return new Date(x * 1000).toLocaleTimeString([], { hour12: false });
  return fmt(x);
}

export class LineChart {
  /**
   * parent: where the chart goes; title; unit (after the y labels); series: [{name}], one
   * line each; maxPoints: the newest points kept (push drops the oldest).
   * Optional: xFormat(x) -> string for the x labels (default: epoch seconds as time of day,
   * other numbers as they are); yMin (default 0; null: the data's minimum).
   */
  constructor(parent, { title = '', unit = '', series = [], maxPoints = 600, xFormat, yMin = 0 } = {}) {
    this.unit = unit;
    this.series = series.map((s, i) => ({ name: String(s.name), color: COLORS[i % COLORS.length] }));
    this.maxPoints = maxPoints;
    this.xFormat = xFormat || xLabel;
    this.yMin = yMin;
    this.xs = [];
    this.values = this.series.map(() => []);
    this.canvas = el('canvas', { class: 'chart-canvas', attrs: { width: 600, height: 180 } });
    this.legend = el(
      'div',
      { class: 'chart-legend' },
      ...this.series.map((s, i) =>
        el('span', { class: 'legend-item' }, el('span', { class: `swatch c${i % COLORS.length}` }), s.name),
      ),
    );
    this.root = el(
      'figure',
      { class: 'chart' },
      el('figcaption', { class: 'chart-title', text: unit ? `${title} (${unit})` : title }),
      this.canvas,
      this.legend,
    );
    parent.appendChild(this.root);
    this.pending = false;
    if (typeof ResizeObserver !== 'undefined') {
      this.resizer = new ResizeObserver(() => this.draw());
      this.resizer.observe(this.canvas);
    }
    this.draw();
  }

  /** One point: `values` has one number per series (null: no value there). */
  push(x, values) {
    this.xs.push(x);
    this.series.forEach((_, i) => this.values[i].push(values[i] ?? null));
    const extra = this.xs.length - this.maxPoints;
    if (extra > 0) {
      this.xs.splice(0, extra);
      this.values.forEach((v) => v.splice(0, extra));
    }
    this.schedule();
  }

  /** Every point at once: `valuesPerSeries[i][j]` is series i at xs[j]. */
  setData(xs, valuesPerSeries) {
    const start = Math.max(0, xs.length - this.maxPoints);
    this.xs = xs.slice(start);
    this.values = this.series.map((_, i) => (valuesPerSeries[i] || []).slice(start).map((v) => v ?? null));
    this.schedule();
  }

  /** Stop watching the canvas's size (the chart's page is left). */
  destroy() {
    if (this.resizer) this.resizer.disconnect();
    this.root.remove();
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    const run = () => {
      this.pending = false;
      this.draw();
    };
    if (typeof requestAnimationFrame === 'function' && !document.hidden) requestAnimationFrame(run);
    else setTimeout(run, 0);
  }

  draw() {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = Math.max(200, Math.round((canvas.clientWidth || 600) * ratio));
    const height = Math.max(100, Math.round((canvas.clientHeight || 180) * ratio));
    if (canvas.width !== width) canvas.width = width;
    if (canvas.height !== height) canvas.height = height;
    const g = canvas.getContext('2d');
    if (!g) return;
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    const w = width / ratio;
    const h = height / ratio;
    g.clearRect(0, 0, w, h);
    const pad = { left: 52, right: 10, top: 8, bottom: 20 };
    const plotW = w - pad.left - pad.right;
    const plotH = h - pad.top - pad.bottom;
    let lo = Infinity;
    let hi = -Infinity;
    for (const series of this.values) {
      for (const v of series) {
        if (v === null || !Number.isFinite(v)) continue;
        lo = Math.min(lo, v);
        hi = Math.max(hi, v);
      }
    }
    const empty = lo === Infinity;
    if (empty) {
      lo = 0;
      hi = 1;
    }
    if (this.yMin !== null && this.yMin !== undefined) lo = Math.min(lo, this.yMin);
    if (hi <= lo) hi = lo + (Math.abs(lo) || 1);
    const x0 = this.xs.length ? this.xs[0] : 0;
    const x1 = this.xs.length ? this.xs[this.xs.length - 1] : 1;
    const xSpan = x1 > x0 ? x1 - x0 : 1;
    const px = (x) => pad.left + ((x - x0) / xSpan) * plotW;
    const py = (v) => pad.top + plotH - ((v - lo) / (hi - lo)) * plotH;

    const style = getComputedStyle(canvas);
    const ink = style.color || '#444';
    g.strokeStyle = ink;
    g.globalAlpha = 0.25;
    g.lineWidth = 1;
    g.beginPath();
    g.moveTo(pad.left, pad.top);
    g.lineTo(pad.left, pad.top + plotH);
    g.lineTo(pad.left + plotW, pad.top + plotH);
    g.moveTo(pad.left, pad.top);
    g.lineTo(pad.left + plotW, pad.top);
    g.stroke();
    g.globalAlpha = 1;
    g.fillStyle = ink;
    g.font = '11px system-ui, sans-serif';
    g.textBaseline = 'middle';
    g.textAlign = 'right';
    g.fillText(fmt(hi), pad.left - 6, pad.top + 4);
    g.fillText(fmt(lo), pad.left - 6, pad.top + plotH);
    g.textBaseline = 'alphabetic';
    if (this.xs.length) {
      g.textAlign = 'left';
      g.fillText(this.xFormat(x0), pad.left, h - 5);
      g.textAlign = 'right';
      g.fillText(this.xFormat(x1), pad.left + plotW, h - 5);
    } else {
      g.textAlign = 'center';
      g.fillText('no data yet', pad.left + plotW / 2, pad.top + plotH / 2);
    }

    const present = (v) => v !== null && v !== undefined && Number.isFinite(v);
    this.values.forEach((series, i) => {
      const color = this.series[i].color;
      g.strokeStyle = color;
      g.fillStyle = color;
      g.lineWidth = 1.5;
      g.beginPath();
      let drawing = false;
      series.forEach((v, j) => {
        if (!present(v)) {
          drawing = false;
          return;
        }
        const x = px(this.xs[j]);
        const y = py(v);
        if (drawing) g.lineTo(x, y);
        else g.moveTo(x, y);
        drawing = true;
      });
      g.stroke();
      // A point alone between gaps has no line: a dot shows it.
      series.forEach((v, j) => {
        if (present(v) && !present(series[j - 1]) && !present(series[j + 1])) {
          g.fillRect(px(this.xs[j]) - 2, py(v) - 2, 4, 4);
        }
      });
    });
  }
}
