// The playground: a chat with a served model (or a LoRA adapter / checkpoint served as one)
// through /v1/chat/completions, streamed. Everything the server sends (model names, text,
// thinking, tool calls, tokens) is written with textContent / text nodes, never as HTML.
import { el, clear, errorMessage, fmt, readEvents } from './dom.js';

const DEFAULTS = { temperature: 0.7, top_p: 1, max_tokens: 512, top_logprobs: 3 };

/** A JSON value as a Python literal (for "copy as Python"). */
export function pyLiteral(value, indent = '') {
  const inner = `${indent}    `;
  if (value === null || value === undefined) return 'None';
  if (value === true) return 'True';
  if (value === false) return 'False';
  if (typeof value === 'number') return Number.isFinite(value) ? String(value) : 'None';
  if (typeof value === 'string') return JSON.stringify(value);
  if (Array.isArray(value)) {
    if (!value.length) return '[]';
    return `[\n${value.map((v) => inner + pyLiteral(v, inner)).join(',\n')},\n${indent}]`;
  }
  const entries = Object.entries(value);
  if (!entries.length) return '{}';
  return `{\n${entries.map(([k, v]) => `${inner}${JSON.stringify(k)}: ${pyLiteral(v, inner)}`).join(',\n')},\n${indent}}`;
}

/** A shell word in single quotes. */
function shellQuote(text) {
  return `'${text.replace(/'/g, `'\\''`)}'`;
}

/** The heat-map class of a token's log-probability: lp0 (sure) ... lp9 (unlikely). */
export function heatClass(logprob) {
  const p = Math.exp(logprob);
  return `tok lp${Math.max(0, Math.min(9, Math.floor((1 - p) * 10)))}`;
}

function field(label, input, hint) {
  return el('div', { class: 'field' }, el('label', { text: label }), input, hint ? el('span', { class: 'muted', text: hint }) : null);
}

function numberInput(name, value, { min, max, step } = {}) {
  return el('input', { attrs: { type: 'number', name, id: `pg-${name}`, value: value ?? '', min, max, step } });
}

export async function mount(root, ctx) {
  const history = []; // the conversation as sent: {role, content, tool_calls?, tool_call_id?}
  let running = null; // the AbortController of the reply being streamed

  // Settings
  const model = el('select', { attrs: { id: 'pg-model', name: 'model' } });
  const system = el('textarea', { attrs: { id: 'pg-system', rows: 3, placeholder: 'You are a helpful assistant.' } });
  const temperature = numberInput('temperature', DEFAULTS.temperature, { min: 0, max: 2, step: 0.1 });
  const topP = numberInput('top_p', DEFAULTS.top_p, { min: 0, max: 1, step: 0.05 });
  const maxTokens = numberInput('max_tokens', DEFAULTS.max_tokens, { min: 1, step: 1 });
  const seed = el('input', { attrs: { type: 'number', id: 'pg-seed', name: 'seed', placeholder: 'random', step: 1 } });
  const logprobs = el('input', { attrs: { type: 'checkbox', id: 'pg-logprobs', name: 'logprobs' } });
  const topLogprobs = numberInput('top_logprobs', DEFAULTS.top_logprobs, { min: 0, max: 20, step: 1 });
  const schema = el('textarea', {
    attrs: { id: 'pg-schema', rows: 5, placeholder: '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}' },
  });
  const tools = el('textarea', {
    attrs: {
      id: 'pg-tools',
      rows: 6,
      placeholder: '[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]',
    },
  });
  const toolChoice = el(
    'select',
    { attrs: { id: 'pg-tool-choice' } },
    ...['auto', 'required', 'none'].map((c) => el('option', { attrs: { value: c }, text: c })),
  );
  const settingsError = el('p', { class: 'error', attrs: { id: 'pg-settings-error' } });

  // Chat
  const messages = el('div', { class: 'messages', attrs: { id: 'pg-messages', 'aria-live': 'polite' } });
  const prompt = el('textarea', { attrs: { id: 'pg-prompt', placeholder: 'Message… (Enter to send, Shift+Enter for a new line)' } });
  const send = el('button', { class: 'primary', attrs: { type: 'submit', id: 'pg-send' }, text: 'Send' });
  const stop = el('button', { attrs: { type: 'button', id: 'pg-stop', disabled: true }, text: 'Stop' });
  const reset = el('button', { attrs: { type: 'button', id: 'pg-clear' }, text: 'Clear chat' });
  const copyCurl = el('button', { attrs: { type: 'button', id: 'pg-copy-curl' }, text: 'Copy as curl' });
  const copyPython = el('button', { attrs: { type: 'button', id: 'pg-copy-python' }, text: 'Copy as Python' });
  const snippet = el('pre', { attrs: { id: 'pg-snippet', hidden: true } });
  const tokenInfo = el('div', { class: 'token-info', attrs: { id: 'pg-token-info' } });
  const replyNote = el('span', { class: 'muted', attrs: { id: 'pg-reply-note' } });
  const composer = el(
    'form',
    { class: 'composer', attrs: { id: 'pg-composer' } },
    prompt,
    el('div', { class: 'row' }, send, stop, reset, copyCurl, copyPython, replyNote),
  );

  root.appendChild(
    el(
      'div',
      { class: 'playground' },
      el(
        'aside',
        { class: 'settings card' },
        field('Model', model),
        field('System prompt', system),
        el('div', { class: 'row' }, field('Temperature', temperature), field('top_p', topP)),
        el('div', { class: 'row' }, field('Max tokens', maxTokens), field('Seed', seed)),
        el('div', { class: 'row' }, el('label', { attrs: { for: 'pg-logprobs' } }, logprobs, ' Logprobs heat-map'), field('Top logprobs', topLogprobs)),
        el('details', {}, el('summary', { text: 'JSON schema (structured output)' }), schema),
        el('details', {}, el('summary', { text: 'Tools (JSON array of definitions)' }), tools, field('tool_choice', toolChoice)),
        settingsError,
      ),
      el('section', { class: 'chat' }, messages, tokenInfo, composer, snippet),
    ),
  );

  // Models
  const requested = ctx.takeRequestedModel ? ctx.takeRequestedModel() : null;
  try {
    const listed = await ctx.json('/v1/models');
    const ids = (listed.data || []).filter((m) => m.task !== 'embed').map((m) => String(m.id)); // chat models only
    if (requested && !ids.includes(requested)) ids.push(String(requested));
    for (const id of ids) model.appendChild(el('option', { attrs: { value: id }, text: id }));
    if (requested) model.value = String(requested);
  } catch (error) {
    settingsError.textContent = `Models: ${error.message}`;
  }

  function parseJSON(text, what) {
    if (!text.trim()) return undefined;
    try {
      return JSON.parse(text);
    } catch (error) {
      throw new Error(`${what} is not valid JSON: ${error.message}`);
    }
  }

  /** The request body for the conversation so far (plus `extra` messages). */
  function body(extra = []) {
    settingsError.textContent = '';
    const request = { model: model.value, messages: [], stream: true };
    if (system.value.trim()) request.messages.push({ role: 'system', content: system.value });
    request.messages.push(...history, ...extra);
    const number = (input, name, integer = false) => {
      if (input.value === '') return;
      const value = integer ? parseInt(input.value, 10) : parseFloat(input.value);
      if (Number.isFinite(value)) request[name] = value;
    };
    number(temperature, 'temperature');
    number(topP, 'top_p');
    number(maxTokens, 'max_tokens', true);
    number(seed, 'seed', true);
    if (logprobs.checked) {
      request.logprobs = true;
      number(topLogprobs, 'top_logprobs', true);
    }
    const jsonSchema = parseJSON(schema.value, 'The JSON schema');
    if (jsonSchema !== undefined) {
      request.response_format = { type: 'json_schema', json_schema: { name: 'playground', schema: jsonSchema, strict: true } };
    }
    let toolList = parseJSON(tools.value, 'The tools');
    if (toolList !== undefined) {
      if (!Array.isArray(toolList)) toolList = [toolList];
      request.tools = toolList.map((t) => (t && t.type ? t : { type: 'function', function: t }));
      request.tool_choice = toolChoice.value;
    }
    request.stream_options = { include_usage: true };
    return request;
  }

  function messageBox(role, label) {
    const content = el('div', { class: 'content' });
    const reasoning = el('div', { class: 'reasoning' });
    const calls = el('div', { class: 'tool-calls' });
    const heatmap = el('div', { class: 'heatmap', attrs: { hidden: true } });
    const meta = el('div', { class: 'meta' });
    const box = el('div', { class: `message ${role}` }, el('div', { class: 'role', text: label || role }), reasoning, content, calls, heatmap, meta);
    messages.appendChild(box);
    box.scrollIntoView({ block: 'end' });
    return { box, content, reasoning, calls, heatmap, meta };
  }

  function showUser(text, label) {
    messageBox('user', label).content.textContent = text;
  }

  function pendingToolCalls() {
    const last = history[history.length - 1];
    if (!last || last.role !== 'assistant' || !last.tool_calls) {
      // Calls answered already are followed by their tool messages.
      const answered = new Set();
      for (let i = history.length - 1; i >= 0; i--) {
        const m = history[i];
        if (m.role === 'tool') answered.add(m.tool_call_id);
        else if (m.role === 'assistant' && m.tool_calls) return m.tool_calls.filter((c) => !answered.has(c.id));
        else break;
      }
      return [];
    }
    return last.tool_calls;
  }

  function updateReplyNote() {
    const pending = pendingToolCalls();
    replyNote.textContent = pending.length ? `Your next message is the result of the tool call ${pending[0].function.name} (${pending[0].id}).` : '';
  }

  function renderToolCall(container, call) {
    const name = el('span', { class: 'name', text: call.function.name || '(unnamed)' });
    const args = el('pre', { text: prettyArguments(call.function.arguments) });
    container.appendChild(el('div', { class: 'tool-call' }, el('span', { class: 'muted', text: 'tool call ' }), name, args));
  }

  function prettyArguments(text) {
    try {
      return JSON.stringify(JSON.parse(text), null, 2);
    } catch {
      return String(text ?? '');
    }
  }

  function addToken(heatmap, entry) {
    const span = el('span', { class: heatClass(entry.logprob), text: entry.token });
    const alternatives = (entry.top_logprobs || []).map((t) => `${JSON.stringify(t.token)} ${fmt(Math.exp(t.logprob) * 100)}%`);
    const description = `${JSON.stringify(entry.token)}: p=${fmt(Math.exp(entry.logprob) * 100)}% (logprob ${entry.logprob.toFixed(3)})` + (alternatives.length ? ` — top: ${alternatives.join(', ')}` : '');
    span.setAttribute('title', description);
    span.addEventListener('mouseenter', () => {
      tokenInfo.textContent = description;
    });
    heatmap.appendChild(span);
  }

  async function ask(extra, shown) {
    let request;
    try {
      request = body(extra);
    } catch (error) {
      settingsError.textContent = error.message;
      return;
    }
    if (!request.model) {
      settingsError.textContent = 'No model to ask.';
      return;
    }
    shown();
    history.push(...extra);
    const view = messageBox('assistant', request.model);
    const calls = []; // by index: {id, type, function: {name, arguments}}
    let text = '';
    let thinking = '';
    let finish = null;
    let usage = null;
    running = new AbortController();
    send.disabled = true;
    stop.disabled = false;
    const started = performance.now();
    let firstAt = null;
    try {
      const response = await ctx.api('/v1/chat/completions', {
        method: 'POST',
        headers: { 'Content-Type': 'application/json', Accept: 'text/event-stream' },
        body: JSON.stringify(request),
        signal: running.signal,
      });
      if (!response.ok) throw new Error(await errorMessage(response));
      await readEvents(response, (data) => {
        if (data === '[DONE]') return;
        let chunk;
        try {
          chunk = JSON.parse(data);
        } catch {
          return;
        }
        if (chunk.error) throw new Error(chunk.error.message || String(chunk.error));
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          if (firstAt === null && (delta.content || delta.reasoning_content || delta.tool_calls)) firstAt = performance.now();
          const reasoningDelta = delta.reasoning_content ?? delta.reasoning;
          if (reasoningDelta) {
            thinking += reasoningDelta;
            view.reasoning.textContent = thinking;
          }
          if (delta.content) {
            text += delta.content;
            view.content.textContent = text;
          }
          for (const part of delta.tool_calls || []) {
            const index = part.index ?? calls.length;
            const call = (calls[index] ||= { id: part.id || `call_${index}`, type: 'function', function: { name: '', arguments: '' } });
            if (part.id) call.id = part.id;
            if (part.function?.name) call.function.name += part.function.name;
            if (part.function?.arguments) call.function.arguments += part.function.arguments;
            clear(view.calls);
            calls.filter(Boolean).forEach((c) => renderToolCall(view.calls, c));
          }
          for (const entry of choice.logprobs?.content || []) {
            // The heat-map shows the answer token by token, in place of its plain text.
            view.heatmap.hidden = false;
            view.content.hidden = true;
            addToken(view.heatmap, entry);
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        view.box.scrollIntoView({ block: 'end' });
      });
    } catch (error) {
      if (error.name === 'AbortError') finish = 'stopped';
      else view.meta.appendChild(el('span', { class: 'error', text: error.message || String(error) }));
    } finally {
      running = null;
      send.disabled = false;
      stop.disabled = true;
    }
    const assistant = { role: 'assistant', content: text || (calls.length ? null : '') };
    const made = calls.filter(Boolean);
    if (made.length) assistant.tool_calls = made;
    history.push(assistant);
    const parts = [];
    if (finish) parts.push(`finish: ${finish}`);
    if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    if (firstAt !== null) parts.push(`first token ${fmt((firstAt - started) / 1000)} s, total ${fmt((performance.now() - started) / 1000)} s`);
    view.meta.insertBefore(document.createTextNode(parts.join(' · ')), view.meta.firstChild);
    updateReplyNote();
  }

  composer.addEventListener('submit', (event) => {
    event.preventDefault();
    if (running) return;
    const text = prompt.value;
    if (!text.trim()) return;
    const pending = pendingToolCalls();
    const message = pending.length ? { role: 'tool', tool_call_id: pending[0].id, content: text } : { role: 'user', content: text };
    ask([message], () => {
      prompt.value = '';
      showUser(text, pending.length ? `tool result: ${pending[0].function.name}` : 'user');
    });
  });
  prompt.addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      composer.requestSubmit();
    }
  });
  stop.addEventListener('click', () => running && running.abort());
  reset.addEventListener('click', () => {
    if (running) running.abort();
    history.length = 0;
    clear(messages);
    tokenInfo.textContent = '';
    updateReplyNote();
  });

  function nextRequest() {
    const text = prompt.value.trim();
    const pending = pendingToolCalls();
    const extra = text ? [pending.length ? { role: 'tool', tool_call_id: pending[0].id, content: text } : { role: 'user', content: text }] : [];
    return body(extra);
  }

  async function copy(kind) {
    let request;
    try {
      request = nextRequest();
    } catch (error) {
      settingsError.textContent = error.message;
      return;
    }
    const base = `${location.origin}/v1`;
    let text;
    if (kind === 'curl') {
      text = [
        `curl -N ${shellQuote(`${base}/chat/completions`)}`,
        `  -H 'Content-Type: application/json'`,
        ctx.keyed ? `  -H "Authorization: Bearer $INFER_API_KEY"` : null,
        `  -d ${shellQuote(JSON.stringify(request, null, 2))}`,
      ]
        .filter(Boolean)
        .join(' \\\n');
    } else {
      const { model: name, messages: msgs, stream, stream_options: _, ...rest } = request;
      text = [
        'import os',
        '',
        'from openai import OpenAI',
        '',
        `client = OpenAI(base_url=${JSON.stringify(base)}, api_key=os.environ.get("INFER_API_KEY", "unused"))`,
        'stream = client.chat.completions.create(',
        `    model=${JSON.stringify(name)},`,
        `    messages=${pyLiteral(msgs, '    ')},`,
        ...Object.entries(rest).map(([k, v]) => `    ${k}=${pyLiteral(v, '    ')},`),
        `    stream=${stream ? 'True' : 'False'},`,
        ')',
        'for chunk in stream:',
        '    if chunk.choices and chunk.choices[0].delta.content:',
        '        print(chunk.choices[0].delta.content, end="", flush=True)',
        'print()',
      ].join('\n');
    }
    snippet.hidden = false;
    snippet.textContent = text;
    try {
      await navigator.clipboard.writeText(text);
      replyNote.textContent = `Copied as ${kind === 'curl' ? 'curl' : 'Python'}.`;
    } catch {
      replyNote.textContent = 'Select the snippet below to copy it.';
    }
  }
  copyCurl.addEventListener('click', () => copy('curl'));
  copyPython.addEventListener('click', () => copy('python'));

  prompt.focus();
  return {
    unmount() {
      if (running) running.abort();
    },
  };
}
