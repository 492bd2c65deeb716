// DOM helpers of the console. Every server-provided string goes in as text (a Text node or
// textContent), never as HTML: model output, tool calls, model, tenant and run names are
// untrusted. No inline styles either: the Content-Security-Policy forbids them.

/**
 * A new element: `el('button', {class: 'primary', text: 'Send', on: {click}}, ...children)`.
 * props: `class` (className), `text` (textContent), `attrs` (setAttribute each; names
 * starting with "on" are refused: no inline handlers), `on` (addEventListener each).
 * children: strings become text nodes, Nodes are appended, null / undefined skipped.
 */
export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null) continue;
    if (key === 'class') node.className = value;
    else if (key === 'text') node.textContent = String(value);
    else if (key === 'attrs') {
      for (const [name, v] of Object.entries(value)) {
        if (v === undefined || v === null || v === false) continue;
        const lower = String(name).toLowerCase();
        if (lower.startsWith('on') || lower === 'style' || lower === 'srcdoc') {
          throw new Error(`el(): attribute ${name} is not allowed`);
        }
        node.setAttribute(name, v === true ? '' : String(v));
      }
    } else if (key === 'on') {
      for (const [event, handler] of Object.entries(value)) node.addEventListener(event, handler);
    } else if (key === 'style') {
      throw new Error('el(): inline styles are not allowed (CSP); use a class');
    } else {
      throw new Error(`el(): unknown prop ${key}`);
    }
  }
  append(node, ...children);
  return node;
}

/** Append children to `node`: strings as text nodes, Nodes as they are, null skipped. */
export function append(node, ...children) {
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** Remove every child of `node`. */
export function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
  return node;
}

/** A number for people: 1234 -> "1.23k", 0.5 -> "0.5", null -> "–". */
export function fmt(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return '–';
  const abs = Math.abs(value);
  if (abs >= 1e9) return `${+(value / 1e9).toPrecision(digits)}G`;
  if (abs >= 1e6) return `${+(value / 1e6).toPrecision(digits)}M`;
  if (abs >= 1e4) return `${+(value / 1e3).toPrecision(digits)}k`;
  if (abs >= 1 || abs === 0) return `${+value.toFixed(abs >= 100 ? 0 : 2)}`;
  return `${+value.toPrecision(digits)}`;
}

/** The API's error message from a non-2xx response (OpenAI's schema, Litestar's, text). */
export async function errorMessage(response) {
  let text = '';
  try {
    text = await response.text();
    const body = JSON.parse(text);
    const error = body && (body.error ?? body.detail ?? body.message);
    if (typeof error === 'string') return error;
    if (error && typeof error.message === 'string') return error.message;
  } catch {
    /* not JSON */
  }
  return text ? `${response.status}: ${text.slice(0, 300)}` : `HTTP ${response.status}`;
}

/** Read an SSE response: onData gets each `data:` payload (a string). */
export async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  const flush = (block) => {
    const data = [];
    for (const line of block.split('\n')) {
      if (line.startsWith('data:')) data.push(line.slice(line[5] === ' ' ? 6 : 5));
    }
    if (data.length) onData(data.join('\n'));
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, '\n');
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      flush(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
    }
  }
  if (buffer.trim()) flush(buffer);
}
