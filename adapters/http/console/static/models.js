// Models (an admin key's page): every model the server serves now (GET /v1/models: the base
// model's names, LoRA adapters, Tinker checkpoints the key owns) and the LoRA adapters
// loaded at run time (GET /admin/lora_adapters), each with an Unload button; a form loads a
// PEFT adapter folder under a name (vLLM's POST /v1/load_lora_adapter; the server needs
// --enable-lora). The server's answer (its plain-text success, or its error's message)
// shows under the form. Refreshed every 5 s while shown. Names and folders are the
// operator's text: rendered as text only.
import { el, clear } from './dom.js';
import { cell, poll, table, useStylesheet } from './console-data.js';

const REFRESH_MS = 5000;

/** The kind of a /v1/models card: base (no parent), a Tinker checkpoint, or a LoRA adapter. */
export function modelKind(card, runtime) {
  if (!card.parent) return 'base model';
  if (String(card.id).startsWith('tinker://')) return 'Tinker checkpoint';
  return runtime.has(card.id) ? 'LoRA adapter (loaded at run time)' : 'LoRA adapter';
}

export function mount(root, ctx) {
  useStylesheet();
  const status = el('p', { class: 'status-line', attrs: { id: 'models-status' }, text: 'Loading…' });
  const error = el('p', { class: 'error', attrs: { id: 'models-error', role: 'alert' } });
  const name = el('input', { attrs: { id: 'lora-name', type: 'text', autocomplete: 'off', placeholder: 'name (the model clients send)', 'aria-label': 'Adapter name' } });
  const path = el('input', { attrs: { id: 'lora-path', type: 'text', autocomplete: 'off', placeholder: 'folder on the server (adapter_config.json, adapter_model.safetensors)', 'aria-label': 'Adapter folder' } });
  const load = el('button', { attrs: { type: 'submit', id: 'lora-load' }, text: 'Load' });
  const answer = el('p', { class: 'status-line', attrs: { id: 'lora-answer', role: 'status' } });
  const form = el('form', { class: 'row', attrs: { id: 'lora-form' }, on: { submit: (event) => { event.preventDefault(); loadAdapter(); } } }, name, path, load);
  const { node, body } = table('models-table', [{ label: 'Model' }, { label: 'Kind' }, { label: 'Parent' }, { label: 'Source' }, { label: '' }]);
  root.append(
    el('div', { class: 'row page-head' }, el('h2', { text: 'Models' }), el('span', { class: 'muted', text: 'what the server serves; LoRA adapters loaded and unloaded at run time' })),
    status,
    error,
    el('h3', { text: 'Load a LoRA adapter' }),
    form,
    answer,
    el('div', { class: 'table-box' }, node),
  );

  const post = async (url, payload) => {
    const response = await ctx.api(url, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(payload) });
    const text = await response.text();
    if (response.ok) return text;
    let message = text;
    try {
      message = JSON.parse(text).error.message;
    } catch {
      /* not OpenAI's error body: its text as it is */
    }
    throw new Error(message || `HTTP ${response.status}`);
  };

  async function loadAdapter() {
    load.disabled = true;
    answer.textContent = 'Loading…';
    answer.classList.remove('error');
    try {
      answer.textContent = await post('/v1/load_lora_adapter', { lora_name: name.value.trim(), lora_path: path.value.trim() });
      name.value = '';
      path.value = '';
      poller.now();
    } catch (e) {
      answer.textContent = e.message || String(e);
      answer.classList.add('error');
    } finally {
      load.disabled = false;
    }
  }

  async function unload(adapter, button) {
    button.disabled = true;
    try {
      answer.textContent = await post('/v1/unload_lora_adapter', { lora_name: adapter });
      answer.classList.remove('error');
      poller.now();
    } catch (e) {
      answer.textContent = e.message || String(e);
      answer.classList.add('error');
      button.disabled = false;
    }
  }

  const tick = async () => {
    const [models, adapters] = await Promise.all([ctx.json('/v1/models'), ctx.json('/admin/lora_adapters')]);
    if (stopped) return;
    const runtime = new Map((adapters.data || []).map((a) => [a.name, a.path]));
    clear(body);
    for (const card of models.data || []) {
      const action = runtime.has(card.id)
        ? el('button', { attrs: { type: 'button', class: 'unload', 'data-model': card.id }, text: 'Unload' })
        : '';
      if (action) action.addEventListener('click', () => unload(card.id, action));
      body.appendChild(
        el('tr', {}, cell(String(card.id)), cell(modelKind(card, runtime)), cell(card.parent ? String(card.parent) : '—'), cell(String(card.root ?? '')), cell(action)),
      );
    }
    error.textContent = '';
    status.textContent = `${(models.data || []).length} model(s) · ${runtime.size} loaded at run time · updated ${new Date().toLocaleTimeString([], { hour12: false })}`;
  };

  let stopped = false;
  const poller = poll(tick, REFRESH_MS, (e) => {
    if (stopped) return;
    error.textContent = e.message || String(e);
    status.textContent = '';
    clear(body);
  });
  return {
    unmount() {
      stopped = true;
      poller.stop();
    },
  };
}
