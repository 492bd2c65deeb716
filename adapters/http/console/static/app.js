// The console's shell: the API key (when the server has a keys file), the tabs, and the
// `ctx` every page's `mount(root, ctx)` gets. A tab's module is imported when first shown.
import { el, clear, errorMessage, readEvents } from './dom.js';

const KEY = 'infer.console.key'; // sessionStorage only: gone when the browser tab closes
const TABS = [
  ['playground', 'Playground'],
  ['engine', 'Engine'],
  ['tenants', 'Tenants'],
  ['rollouts', 'Rollouts'],
  ['models', 'Models'],
  ['audit', 'Audit'],
  ['training', 'Training'],
];

const state = {
  keyed: false,
  current: null, // {name, page}
  requestedModel: null, // openPlayground's choice, taken by the playground's mount
  generation: 0,
};

function storedKey() {
  try {
    return sessionStorage.getItem(KEY) || '';
  } catch {
    return '';
  }
}

function setKey(key) {
  try {
    if (key) sessionStorage.setItem(KEY, key);
    else sessionStorage.removeItem(KEY);
  } catch {
    /* storage disabled: the key lives until the page reloads */
  }
  memoryKey = key;
}

let memoryKey = storedKey();

function api(path, init = {}) {
  const headers = new Headers(init.headers || {});
  if (memoryKey) headers.set('Authorization', `Bearer ${memoryKey}`);
  return fetch(path, { ...init, headers }).then((response) => {
    if (response.status === 401 && state.keyed) askForKey('The server refused the key; enter another.');
    return response;
  });
}

async function json(path, init) {
  const response = await api(path, init);
  if (!response.ok) throw new Error(await errorMessage(response));
  return response.json();
}

/**
 * A server-sent event stream read with fetch (EventSource cannot send the key): onData gets
 * each event's `data:` JSON. It reconnects after an error or the end of the stream until
 * closed. options: onError(error), onOpen().
 */
function events(path, onData, options = {}) {
  let closed = false;
  let controller = null;
  let retry = null;
  let delay = 1000;

  const dispatch = (text) => {
    let parsed;
    try {
      parsed = JSON.parse(text);
    } catch {
      return;
    }
    onData(parsed);
  };

  const connect = async () => {
    controller = new AbortController();
    try {
      const response = await api(path, { signal: controller.signal, headers: { Accept: 'text/event-stream' } });
      if (!response.ok) throw new Error(await errorMessage(response));
      if (options.onOpen) options.onOpen();
      delay = 1000;
      await readEvents(response, dispatch);
      if (!closed && options.onError) options.onError(new Error('the stream ended; reconnecting'));
    } catch (error) {
      if (closed) return;
      if (options.onError) options.onError(error);
    }
    if (!closed) {
      retry = setTimeout(connect, delay);
      delay = Math.min(delay * 2, 15000);
    }
  };
  connect();
  return {
    close() {
      closed = true;
      clearTimeout(retry);
      if (controller) controller.abort();
    },
  };
}

const ctx = {
  api,
  json,
  events,
  openPlayground({ model } = {}) {
    state.requestedModel = model || null;
    navigate('playground');
  },
  /** The model openPlayground asked for (once), for the playground's mount. */
  takeRequestedModel() {
    const model = state.requestedModel;
    state.requestedModel = null;
    return model;
  },
  get keyed() {
    return state.keyed;
  },
};

const page = document.getElementById('page');
const nav = document.getElementById('tabs');
const keyBox = document.getElementById('key-status');

function tabFromHash() {
  const name = (location.hash || '').replace(/^#\/?/, '');
  return TABS.some(([id]) => id === name) ? name : 'playground';
}

function navigate(name) {
  if (location.hash !== `#${name}`) location.hash = name; // hashchange shows it
  else show(name);
}

function leave() {
  const current = state.current;
  state.current = null;
  if (current && current.page && typeof current.page.unmount === 'function') {
    try {
      current.page.unmount();
    } catch (error) {
      console.error(error);
    }
  }
}

async function show(name) {
  if (state.keyed && !memoryKey) {
    askForKey();
    return;
  }
  const generation = ++state.generation;
  leave();
  for (const link of nav.querySelectorAll('a')) {
    link.classList.toggle('active', link.dataset.tab === name);
    if (link.dataset.tab === name) link.setAttribute('aria-current', 'page');
    else link.removeAttribute('aria-current');
  }
  clear(page);
  const root = el('section', { class: `tab tab-${name}`, attrs: { 'data-tab': name } });
  page.appendChild(root);
  let module;
  try {
    module = await import(`./${name}.js`);
  } catch (error) {
    if (generation !== state.generation) return;
    console.warn(`the ${name} page did not load`, error);
    root.appendChild(el('p', { class: 'notice', text: `The ${name} page is not available in this build.` }));
    return;
  }
  if (generation !== state.generation) return;
  try {
    const mounted = await module.mount(root, ctx);
    if (generation !== state.generation) {
      if (mounted && typeof mounted.unmount === 'function') mounted.unmount();
      return;
    }
    state.current = { name, page: mounted };
  } catch (error) {
    console.error(error);
    root.appendChild(el('p', { class: 'error', text: `The ${name} page failed: ${error.message || error}` }));
  }
}

// The key form: required on a server with keys; on an open one (``optional``) a key may be
// set all the same (a Tinker key, so that the playground samples that key's checkpoints).
function askForKey(message = '', optional = false) {
  leave();
  state.generation++;
  clear(page);
  const input = el('input', {
    attrs: { type: 'password', id: 'api-key', name: 'api-key', autocomplete: 'off', placeholder: 'sk-…', required: true },
  });
  const status = el('p', { class: 'error', attrs: { id: 'key-error', role: 'alert' }, text: message });
  const form = el(
    'form',
    { class: 'key-form', attrs: { id: 'key-form' } },
    el('h2', { text: 'API key' }),
    el('p', {
      text: optional
        ? 'This server needs no key. A Tinker key (tml-…) lets the playground sample the checkpoints it saved. It is kept in this browser tab only (sessionStorage) and sent as Authorization: Bearer.'
        : 'This server needs an API key. It is kept in this browser tab only (sessionStorage) and sent as Authorization: Bearer.',
    }),
    el('label', { attrs: { for: 'api-key' }, text: 'Key' }),
    input,
    el('button', { class: 'primary', attrs: { type: 'submit' }, text: 'Use key' }),
    optional
      ? el('button', { attrs: { type: 'button', id: 'cancel-key' }, text: 'Cancel', on: { click: () => show(tabFromHash()) } })
      : null,
    status,
  );
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    const key = input.value.trim();
    if (!key) return;
    status.textContent = '';
    const response = await fetch('/ui/api/me', { headers: { Authorization: `Bearer ${key}` } });
    if (!response.ok) {
      status.textContent = await errorMessage(response);
      return;
    }
    setKey(key);
    renderKeyStatus();
    show(tabFromHash());
  });
  page.appendChild(form);
  input.focus();
  renderKeyStatus();
}

function renderKeyStatus() {
  clear(keyBox);
  if (!state.keyed && !memoryKey) {
    keyBox.appendChild(
      el('button', {
        class: 'link',
        attrs: { type: 'button', id: 'set-key' },
        text: 'Set key',
        on: { click: () => askForKey('', true) },
      }),
    );
    return;
  }
  if (memoryKey) {
    keyBox.appendChild(
      el('button', {
        class: 'link',
        attrs: { type: 'button', id: 'forget-key' },
        text: 'Forget key',
        on: {
          click: () => {
            setKey('');
            if (state.keyed) askForKey();
            else {
              renderKeyStatus();
              show(tabFromHash());
            }
          },
        },
      }),
    );
  }
}

async function start() {
  for (const [id, label] of TABS) {
    nav.appendChild(el('a', { attrs: { href: `#${id}`, 'data-tab': id }, text: label }));
  }
  try {
    const info = await (await fetch('/ui/api/info')).json();
    state.keyed = Boolean(info.keyed);
  } catch {
    state.keyed = false;
  }
  renderKeyStatus();
  window.addEventListener('hashchange', () => show(tabFromHash()));
  show(tabFromHash());
}

start();
