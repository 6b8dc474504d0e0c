// lift-serve's page: a chat with your documents. Upload one, ask from the first second (answers
// read the passages that match the question until the document's adapter exists), follow its
// absorption in a compact strip. Vanilla JS, no build step. Server text is always set through
// textContent, never parsed as markup.
'use strict';

const $ = (id) => document.getElementById(id);
const KEY_STORE = 'lift-serve.key';
// Plain names for the API's modes, in the order the page offers them.
const MODES = ['lift', 'rag', 'memory', 'icl'];
const MODE_NAME = { lift: 'Absorbed + passages', rag: 'Passages only', memory: 'Absorbed only', icl: 'Head and tail only' };
const MODE_HELP = {
  lift: 'The document’s absorbed adapter, reading the passages that match your question (before the adapter exists: passages only).',
  rag: 'The base model reading the passages that match your question, no adapter.',
  memory: 'Only what the adapter absorbed: no document text is shown to the model.',
  icl: 'The base model reading the document’s beginning and end only (a baseline).',
};
const TERMINAL = new Set(['ready', 'failed', 'cancelled', 'damaged']);

const state = {
  docs: [],            // last GET /documents
  selected: null,      // selected document id
  view: null,          // latest Document of the selected one
  follow: null,        // AbortController of the selected document's event stream
  loss: new Map(),     // id -> [[step, loss]], from training progress events
  rate: new Map(),     // id -> {stage, t0, s0, t, s}: observed step rate for the ETA
  started: new Map(),  // id -> time the page first saw it training
  posted: new Map(),   // id -> {estimate, warnings, at}: what POST /documents said it would cost
  threads: new Map(),  // id -> the turns of a document not shown now
  file: null,          // the file chosen or dropped (the first, for the cost estimate)
  files: [],           // every file chosen or dropped: several make a collection
  cols: [],            // last GET /collections
  tab: 'file',
  listTimer: 0,
  asking: false,
  mode: 'lift',
  costTimer: 0,
  costSeq: 0,
};

// ---------- small helpers ----------

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function fmtNum(n, digits = 1) {
  if (n === null || n === undefined || !isFinite(n)) return '–';
  const a = Math.abs(n);
  if (a >= 1e9) return (n / 1e9).toFixed(digits) + ' G';
  if (a >= 1e6) return (n / 1e6).toFixed(digits) + ' M';
  if (a >= 1e4) return (n / 1e3).toFixed(digits) + ' k';
  if (Number.isInteger(n) || a >= 100) return String(Math.round(n));
  return n.toFixed(a < 10 ? 2 : 1);
}

function fmtBytes(b) {
  if (b === null || b === undefined || !isFinite(b)) return '–';
  const u = ['B', 'KB', 'MB', 'GB'];
  let i = 0;
  while (b >= 1000 && i < u.length - 1) { b /= 1000; i++; }
  return (i === 0 ? String(b) : b.toFixed(b < 10 ? 2 : 1)) + ' ' + u[i];
}

function fmtSecs(s) {
  if (s === null || s === undefined || !isFinite(s) || s < 0) return '–';
  if (s < 10) return s.toFixed(1) + ' s';
  if (s < 90) return Math.round(s) + ' s';
  const m = Math.floor(s / 60);
  if (m < 90) return m + ' min ' + Math.round(s - m * 60) + ' s';
  return Math.floor(m / 60) + ' h ' + (m % 60) + ' min';
}

function fmtTime(unix) {
  if (!unix) return '–';
  const d = new Date(unix * 1000);
  const today = new Date();
  return d.toDateString() === today.toDateString()
    ? d.toLocaleTimeString([], { hour: '2-digit', minute: '2-digit' })
    : d.toLocaleDateString([], { month: 'short', day: 'numeric' }) + ' ' + d.toLocaleTimeString([], { hour: '2-digit', minute: '2-digit' });
}

// ---------- errors ----------

class ApiError extends Error {
  constructor(status, body) {
    const e = (body && body.error) || {};
    super(e.message || ('HTTP ' + status));
    this.status = status;
    this.code = e.code || ('http_' + status);
    this.type = e.type || '';
    this.param = e.param || null;
  }
}

function toast(message, code, kind = 'error') {
  const t = el('div', 'toast ' + kind);
  t.setAttribute('role', kind === 'error' ? 'alert' : 'status');
  t.dataset.testid = 'toast';
  if (code) t.dataset.code = code;
  const msg = el('span', 'toast-msg', message);
  t.append(msg);
  if (code) t.append(el('code', 'toast-code', code));
  const x = el('button', 'toast-x', '×');
  x.type = 'button';
  x.setAttribute('aria-label', 'dismiss');
  x.addEventListener('click', () => t.remove());
  t.append(x);
  $('toasts').append(t);
  setTimeout(() => t.remove(), kind === 'error' ? 15000 : 4000);
}

function showError(err, context) {
  if (err && err.name === 'AbortError') return;
  if (err instanceof ApiError) {
    const where = context ? context + ': ' : '';
    const param = err.param ? ' (' + err.param + ')' : '';
    toast(where + err.message + param, err.code);
  } else {
    toast((context ? context + ': ' : '') + 'network error — ' + ((err && err.message) || err), 'network_error');
  }
}

// ---------- API ----------

function key() { return localStorage.getItem(KEY_STORE) || ''; }

function headers(extra, k) {
  const h = Object.assign({}, extra || {});
  k = k === undefined ? key() : k;
  if (k) h.Authorization = 'Bearer ' + k;
  return h;
}

// Throws ApiError for any non-2xx answer (after asking for a key again on 401).
async function check(resp) {
  if (resp.ok) return resp;
  let body = null;
  try { body = await resp.json(); } catch (_) { /* not JSON */ }
  const err = new ApiError(resp.status, body);
  if (resp.status === 401) needKey(err.code === 'invalid_api_key' ? 'refused' : 'missing');
  throw err;
}

async function api(method, path, body, signal) {
  const init = { method, headers: headers(), signal };
  if (body instanceof FormData) init.body = body;
  else if (body !== undefined) {
    init.headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  const resp = await check(await fetch(path, init));
  if (resp.status === 204) return { status: 204, data: null };
  return { status: resp.status, data: await resp.json() };
}

// The key prompt: 'missing' (the server needs a key), 'refused' (the key given was refused), or
// null (hidden).
function needKey(reason) {
  const box = $('auth-prompt');
  box.hidden = !reason;
  box.dataset.reason = reason || '';
  document.body.classList.toggle('needs-key', !!reason);
  if (!reason) return;
  if (reason === 'refused') {
    $('auth-title').textContent = 'This key was refused.';
    $('auth-text').textContent = 'The server does not know it (invalid_api_key). Check it and enter it again at the top.';
  } else {
    $('auth-title').textContent = 'This server needs an API key.';
    $('auth-text').textContent = 'Enter your key in the field at the top and press “Use key”.';
  }
  $('key-input').focus();
  $('key-input').select();
}

// A text/event-stream read through fetch (EventSource cannot send the Authorization header):
// calls onEvent(name, data) per event; resolves when the stream ends.
async function readSSE(resp, onEvent) {
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = '';
  let name = '', data = [];
  const line = (l) => {
    if (l === '') {
      if (data.length) onEvent(name || 'message', data.join('\n'));
      name = ''; data = [];
      return;
    }
    if (l[0] === ':') return;
    const i = l.indexOf(':');
    const field = i < 0 ? l : l.slice(0, i);
    let value = i < 0 ? '' : l.slice(i + 1);
    if (value[0] === ' ') value = value.slice(1);
    if (field === 'event') name = value;
    else if (field === 'data') data.push(value);
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let nl;
    while ((nl = buf.search(/\r\n|\r|\n/)) >= 0) {
      const crlf = buf[nl] === '\r' && buf[nl + 1] === '\n';
      // A lone '\r' at the end of the buffer may be the first half of '\r\n'.
      if (buf[nl] === '\r' && nl === buf.length - 1) break;
      line(buf.slice(0, nl));
      buf = buf.slice(nl + (crlf ? 2 : 1));
    }
  }
  buf += dec.decode();
  if (buf) line(buf);
  line('');
}

// ---------- key ----------

function initKey() {
  $('key-input').value = key();
  $('key-form').addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const k = $('key-input').value.trim();
    if (!k) {
      localStorage.removeItem(KEY_STORE);
      toast('Key cleared.', null, 'info');
      loadList();
      return;
    }
    // The key is tried before it is kept: a refused key is said to be refused, never "saved".
    let resp;
    try { resp = await fetch('/documents', { headers: headers({}, k) }); } catch (e) { showError(e, 'Key'); return; }
    if (resp.status === 401) {
      localStorage.removeItem(KEY_STORE);
      needKey('refused');
      return;
    }
    localStorage.setItem(KEY_STORE, k);
    needKey(null);
    toast('Key accepted.', null, 'info');
    loadList();
    if (state.selected) select(state.selected, true);
  });
}

// ---------- upload, and its cost said before it is paid ----------

function setTab(tab) {
  state.tab = tab;
  for (const t of ['file', 'paste']) {
    $('tab-' + t).classList.toggle('active', t === tab);
    $('tab-' + t).setAttribute('aria-selected', String(t === tab));
    $('pane-' + t).hidden = t !== tab;
  }
  scheduleCost();
}

// Several files at once are absorbed each and made one collection, asked as one chat.
function setFiles(list) {
  state.files = [...(list || [])];
  setFile(state.files[0]);
  if (state.files.length > 1) $('drop-text').textContent = state.files.length + ' files · one collection';
}

function setFile(f) {
  state.file = f || null;
  if (!f) state.files = [];
  $('drop-text').textContent = f ? f.name + ' · ' + fmtBytes(f.size) : '';
  if (!f) {
    $('drop-text').append('Drop a file here or ', el('u', null, 'choose one'));
  }
  $('drop-zone').classList.toggle('has-file', !!f);
  scheduleCost();
}

function absorbOptions() {
  const o = {};
  const adapter = $('opt-adapter').value;
  if (adapter) o.adapter = adapter;
  const int = (id) => {
    const v = $(id).value.trim();
    return v === '' ? null : Number(v);
  };
  const w = int('opt-window');
  if (w !== null) o.window = w;
  const e1 = int('opt-epochs-seg'), e2 = int('opt-epochs-qa');
  if (e1 !== null || e2 !== null) {
    if (e1 === null || e2 === null) throw new Error('set both epoch numbers (text only, text + questions) or neither');
    o.epochs = [e1, e2];
  }
  const q = int('opt-aux-qa');
  if (q !== null) o.aux_qa = q;
  const schedule = $('opt-schedule').value;
  if (schedule) o.until_learned = schedule === 'until_learned';
  // The plan is fitted to the budget; the cost line's warnings say what was given up.
  const minutes = int('opt-budget');
  if (minutes !== null) o.budget_seconds = minutes * 60;
  return Object.keys(o).length ? o : null;
}

// The POST /documents body for what the form holds; null when there is nothing to send yet
// (only for a dry run: a real submit sends even an empty paste, and the server says why not).
function documentBody(options, dryRun) {
  const title = $('doc-title').value.trim();
  if (state.tab === 'file') {
    if (!state.file) return null;
    const body = new FormData();
    body.append('file', state.file, state.file.name);
    if (title) body.append('title', title);
    if (options) body.append('options', JSON.stringify(options));
    if (dryRun) body.append('dry_run', 'true');
    return body;
  }
  const text = $('paste-text').value;
  if (dryRun && !text.trim()) return null;
  const body = { text };
  if (title) body.title = title;
  if (options) body.options = options;
  if (dryRun) body.dry_run = true;
  return body;
}

function scheduleCost() {
  clearTimeout(state.costTimer);
  state.costTimer = setTimeout(updateCost, 350);
}

// Asks the server what absorbing would cost (a dry run: nothing is stored) as the form changes.
async function updateCost() {
  const seq = ++state.costSeq;
  let options;
  try { options = absorbOptions(); } catch (e) { renderCost(null, e.message); return; }
  const body = documentBody(options, true);
  if (!body) { $('cost').hidden = true; return; }
  try {
    const r = await api('POST', '/documents', body);
    if (seq === state.costSeq) renderCost(r.data);
  } catch (e) {
    if (seq !== state.costSeq || (e instanceof ApiError && e.status === 401)) return;
    renderCost(null, e instanceof ApiError ? e.message + ' [' + e.code + ']' : 'network error — ' + e.message);
  }
}

function costSentence(est) {
  const e = est.estimate;
  const how = e.rate === 'measured'
    ? 'at this server’s measured speed (' + e.measured_absorbs + ' absorb' + (e.measured_absorbs === 1 ? '' : 's') + ')'
    : e.rate === 'calibrated'
      ? 'at the speed of a few training steps timed when the server started; no absorb has finished yet'
      : 'a first guess: no absorb has finished on this server yet';
  return 'Absorbing takes about ' + fmtSecs(e.seconds) + ' — ' + fmtNum(e.planned_steps) + ' training steps over ' +
    fmtNum(est.tokens) + ' tokens, ' + e.qa_pairs + ' practice questions (' + how + '). You can ask at once: answers read the passages until then.';
}

function renderWarnings(ul, warnings) {
  ul.replaceChildren();
  for (const w of warnings || []) {
    const li = el('li', 'warning', w.message);
    li.dataset.code = w.code;
    li.dataset.testid = 'warning';
    ul.append(li);
  }
  ul.hidden = !(warnings && warnings.length);
}

function renderCost(est, error) {
  $('cost').hidden = false;
  $('cost').dataset.state = est ? 'ok' : 'error';
  $('cost-text').textContent = est ? costSentence(est) : 'Cannot absorb this: ' + error;
  renderWarnings($('cost-warnings'), est ? est.warnings : []);
  if (est) $('cost').dataset.steps = String(est.estimate.planned_steps);
}

async function submitDoc(ev) {
  ev.preventDefault();
  let options;
  try { options = absorbOptions(); } catch (e) { toast(e.message, 'invalid_options'); return; }
  if (state.tab === 'file' && state.files.length > 1) { submitCollection(options); return; }
  const body = documentBody(options, false);
  if (!body) { toast('Choose or drop a file first (or paste text).', 'no_file'); return; }
  await busy(async (say) => {
    say('Sending…');
    const r = await api('POST', '/documents', body);
    const d = r.data;
    state.posted.set(d.id, { estimate: d.estimate, warnings: d.warnings || [], at: performance.now() });
    toast(r.status === 200 ? 'Already known: the same document with the same options.'
      : 'Absorbing, about ' + fmtSecs(d.estimate && d.estimate.seconds) + '. Ask away meanwhile.', null, 'info');
    if (state.tab === 'file') { setFile(null); $('file-input').value = ''; } else $('paste-text').value = '';
    $('doc-title').value = '';
    $('cost').hidden = true;
    upsert(d);
    select(d.id);
    $('question').focus();
  });
}

// Runs an upload with the button saying it is busy (`say`); an error shows as a toast.
async function busy(work) {
  const btn = $('submit-doc');
  btn.disabled = true;
  try {
    await work((text) => { btn.textContent = text; });
  } catch (e) {
    showError(e, 'Upload');
  } finally {
    btn.disabled = false;
    btn.textContent = 'Absorb document';
  }
}

// Posts every chosen file, then one collection of them, selected as one chat.
async function submitCollection(options) {
  const files = state.files.slice();
  const ids = [];
  await busy(async (say) => {
    for (const [i, f] of files.entries()) {
      say('Sending ' + (i + 1) + ' of ' + files.length + '…');
      const body = new FormData();
      body.append('file', f, f.name);
      if (options) body.append('options', JSON.stringify(options));
      const r = await api('POST', '/documents', body);
      ids.push(r.data.id);
      upsert(r.data);
    }
    const title = $('doc-title').value.trim() || files.map((f) => f.name).join(', ').slice(0, 200);
    const c = await api('POST', '/collections', { title, document_ids: ids });
    state.cols.push(c.data);
    setFile(null);
    $('file-input').value = '';
    $('doc-title').value = '';
    $('cost').hidden = true;
    toast('A collection of ' + ids.length + ' documents: ask them as one.', null, 'info');
    select(c.data.id);
    $('question').focus();
  });
}

const isCollection = (id) => typeof id === 'string' && id.startsWith('col_');

function initUpload() {
  $('tab-file').addEventListener('click', () => setTab('file'));
  $('tab-paste').addEventListener('click', () => setTab('paste'));
  $('file-input').addEventListener('change', (ev) => setFiles(ev.target.files));
  const zone = $('drop-zone');
  const over = (on) => (ev) => { ev.preventDefault(); zone.classList.toggle('over', on); };
  zone.addEventListener('dragenter', over(true));
  zone.addEventListener('dragover', over(true));
  zone.addEventListener('dragleave', over(false));
  zone.addEventListener('drop', (ev) => {
    over(false)(ev);
    const files = ev.dataTransfer && ev.dataTransfer.files;
    if (files && files.length) { setTab('file'); setFiles(files); }
  });
  // A file dropped elsewhere on the page must not navigate away from it.
  window.addEventListener('dragover', (ev) => ev.preventDefault());
  window.addEventListener('drop', (ev) => ev.preventDefault());
  $('upload-form').addEventListener('submit', submitDoc);
  for (const id of ['paste-text', 'opt-adapter', 'opt-window', 'opt-epochs-seg', 'opt-epochs-qa', 'opt-aux-qa', 'opt-budget', 'opt-schedule']) {
    $(id).addEventListener('input', scheduleCost);
    $(id).addEventListener('change', scheduleCost);
  }
  setFile(null);
}

// ---------- document list ----------

async function loadList() {
  clearTimeout(state.listTimer);
  state.listTimer = 0;
  try {
    const r = await api('GET', '/documents');
    state.docs = r.data.data || [];
    state.cols = (await api('GET', '/collections')).data.data || [];
    needKey(null);
    renderList();
  } catch (e) {
    if (!(e instanceof ApiError && e.status === 401)) showError(e, 'Documents');
    else { state.docs = []; renderList(); }
  }
  scheduleList();
}

// Polls while some document is still queued or training.
function scheduleList() {
  if (!state.listTimer && state.docs.some((d) => !TERMINAL.has(d.status))) state.listTimer = setTimeout(loadList, 3000);
}

function upsert(d) {
  const i = state.docs.findIndex((x) => x.id === d.id);
  if (i >= 0) state.docs[i] = d; else state.docs.push(d);
  renderList();
  scheduleList();
}

function statusText(d) {
  if (d.status === 'training' && d.progress && d.progress.steps) return 'absorbing ' + Math.round(100 * d.progress.step / d.progress.steps) + '%';
  return { queued: 'waiting', training: 'absorbing', ready: 'absorbed', failed: 'failed', cancelled: 'cancelled', damaged: 'damaged' }[d.status] || d.status;
}

function renderList() {
  const ul = $('doc-list');
  ul.replaceChildren();
  $('doc-empty').hidden = state.docs.length + state.cols.length > 0;
  for (const c of state.cols.slice().reverse()) {
    const li = el('li', 'docrow' + (c.id === state.selected ? ' selected' : ''));
    li.dataset.id = c.id;
    li.dataset.testid = 'collection-row';
    li.tabIndex = 0;
    const main = el('div', 'docmain');
    main.append(el('span', 'doctitle', c.title || c.id));
    main.append(el('span', 'docmeta muted small', c.document_ids.length + ' documents · ' + fmtTime(c.created_at)));
    li.append(main, el('span', 'badge ready', 'collection'));
    li.addEventListener('click', () => select(c.id));
    li.addEventListener('keydown', (ev) => { if (ev.key === 'Enter') select(c.id); });
    ul.append(li);
  }
  for (const d of state.docs.slice().reverse()) {
    const li = el('li', 'docrow' + (d.id === state.selected ? ' selected' : ''));
    li.dataset.id = d.id;
    li.dataset.status = d.status;
    li.dataset.testid = 'doc-row';
    li.tabIndex = 0;
    const main = el('div', 'docmain');
    main.append(el('span', 'doctitle', d.title || d.id));
    main.append(el('span', 'docmeta muted small', fmtNum(d.tokens) + ' tokens · ' + fmtTime(d.created_at)));
    const badge = el('span', 'badge ' + d.status, statusText(d));
    const del = el('button', 'btn ghost small danger', '✕');
    del.type = 'button';
    del.dataset.testid = 'delete';
    del.title = 'delete this document and its adapter';
    del.setAttribute('aria-label', 'delete ' + (d.title || d.id));
    del.addEventListener('click', (ev) => { ev.stopPropagation(); remove(d); });
    li.append(main, badge, del);
    li.addEventListener('click', () => select(d.id));
    li.addEventListener('keydown', (ev) => { if (ev.key === 'Enter') select(d.id); });
    ul.append(li);
  }
}

async function remove(d) {
  if (!confirm('Delete “' + (d.title || d.id) + '”? Its adapter and this conversation are removed.')) return;
  try {
    await api('DELETE', '/documents/' + encodeURIComponent(d.id));
    state.docs = state.docs.filter((x) => x.id !== d.id);
    state.loss.delete(d.id);
    state.threads.delete(d.id);
    state.posted.delete(d.id);
    if (state.selected === d.id) { state.selected = null; select(null, true); }
    renderList();
    toast('Deleted.', null, 'info');
  } catch (e) {
    showError(e, 'Delete');
  }
}

// ---------- the selected document ----------

function select(id, force) {
  if (id === state.selected && !force) return;
  if (state.follow) state.follow.abort();
  state.follow = null;
  // Each document keeps its own conversation.
  const thread = $('thread');
  const turns = [...thread.querySelectorAll(':scope > .turn')];
  if (state.selected && [...state.docs, ...state.cols].some((d) => d.id === state.selected)) state.threads.set(state.selected, turns);
  for (const t of turns) t.remove();
  for (const t of state.threads.get(id) || []) thread.append(t);
  state.selected = id;
  state.view = id ? (isCollection(id) ? state.cols : state.docs).find((d) => d.id === id) || null : null;
  renderList();
  renderDoc();
  if (id && !isCollection(id)) follow(id);
}

async function follow(id) {
  const ctl = new AbortController();
  state.follow = ctl;
  for (let attempt = 0; attempt < 5 && !ctl.signal.aborted; attempt++) {
    let finished = false;
    try {
      const resp = await check(await fetch('/documents/' + encodeURIComponent(id) + '/events',
        { headers: headers({ Accept: 'text/event-stream' }), signal: ctl.signal }));
      await readSSE(resp, (name, data) => {
        if (ctl.signal.aborted) return;
        if (name === 'progress' || name === 'done') {
          onProgress(JSON.parse(data));
          if (name === 'done') finished = true;
        } else if (name === 'error') {
          finished = true;
          let body = null;
          try { body = JSON.parse(data); } catch (_) { /* not JSON */ }
          showError(new ApiError(503, body), 'Progress stream');
        }
      });
    } catch (e) {
      if (ctl.signal.aborted) return;
      showError(e, 'Progress stream');
      if (e instanceof ApiError) return;
    }
    if (finished || ctl.signal.aborted) return;
    await new Promise((r) => setTimeout(r, 1000 * (attempt + 1)));
  }
}

function onProgress(d) {
  const now = performance.now();
  const p = d.progress;
  if (p && p.stage === 'training' && typeof p.loss === 'number' && typeof p.step === 'number') {
    const pts = state.loss.get(d.id) || [];
    const last = pts[pts.length - 1];
    if (!last || last[0] !== p.step) pts.push([p.step, p.loss]);
    else last[1] = p.loss;
    state.loss.set(d.id, pts);
  }
  if (d.status === 'training' && !state.started.has(d.id)) state.started.set(d.id, now);
  if (p && typeof p.step === 'number' && p.steps) {
    const r = state.rate.get(d.id);
    if (!r || r.stage !== p.stage || p.step < r.s) state.rate.set(d.id, { stage: p.stage, t0: now, s0: p.step, t: now, s: p.step });
    else if (p.step !== r.s) { r.t = now; r.s = p.step; }
  }
  upsert(d);
  if (d.id === state.selected) { state.view = d; renderDoc(); }
}

const STAGES = {
  tokenizing: 'Reading the document',
  generating_qa: 'Writing practice questions',
  training: 'Absorbing',
  saving: 'Saving the adapter',
};

function renderDoc() {
  const d = state.view;
  const status = $('doc-status');
  $('doc-error').hidden = true;
  $('thread-empty').hidden = !!d && $('thread').querySelector('.turn') !== null;
  $('doc-hint').hidden = false;
  if (!d) {
    $('doc-heading').textContent = 'No document selected';
    status.textContent = '';
    status.className = 'badge';
    status.dataset.status = '';
    $('doc-id').textContent = '';
    $('doc-live').hidden = true;
    $('figures').hidden = true;
    renderAskState();
    return;
  }
  $('doc-heading').textContent = d.title || d.id;
  if (isCollection(d.id)) {
    // A collection is one chat over its documents: no training strip of its own.
    status.textContent = 'collection';
    status.className = 'badge ready';
    status.dataset.status = 'collection';
    $('doc-id').textContent = d.document_ids.length + ' documents · ' + d.id;
    $('doc-live').hidden = true;
    $('figures').hidden = true;
    renderAskState();
    return;
  }
  status.textContent = statusText(d);
  status.className = 'badge ' + d.status;
  status.dataset.status = d.status;
  $('doc-id').textContent = fmtNum(d.tokens) + ' tokens · ' + d.id;
  $('doc-live').hidden = false;
  // Absorbed: the whole curve from the adapter's figures (events skip steps when a reader falls
  // behind, and a reloaded page saw none); while training, the steps the events brought.
  const curve = d.status === 'ready' && d.training && Array.isArray(d.training.step_losses) && d.training.step_losses.length
    ? d.training.step_losses.map((l, i) => [i + 1, l]) : state.loss.get(d.id) || [];
  renderLive(d, curve);
  if (d.status === 'damaged') {
    // The server's message names the way back: post the same text and options again.
    $('doc-error').hidden = false;
    $('doc-error').textContent = 'Adapter damaged: ' + ((d.error && d.error.message) || 'its file no longer matches its hash') + '.';
  } else if (d.status === 'failed' || (d.error && d.error.message)) {
    $('doc-error').hidden = false;
    $('doc-error').textContent = 'Absorbing failed: ' + ((d.error && d.error.message) || 'no reason given') + '. Answers still read the passages.';
  }
  if (d.status === 'ready') renderFigures(d); else $('figures').hidden = true;
  renderAskState();
}

function renderLive(d, pts) {
  const p = d.progress || {};
  const posted = state.posted.get(d.id);
  let frac = 0, steps = '–';
  const stage = d.status === 'ready' ? 'Absorbed' : d.status === 'queued' ? 'Waiting to absorb'
    : STAGES[p.stage] || (d.status === 'failed' ? 'Not absorbed' : d.status === 'cancelled' ? 'Cancelled'
      : d.status === 'damaged' ? 'Adapter damaged' : d.status);
  if (d.status === 'ready') {
    frac = 1;
    if (d.training && d.training.steps) steps = fmtNum(d.training.steps) + (d.training.planned_steps ? ' of ' + fmtNum(d.training.planned_steps) : '');
  } else if (typeof p.step === 'number' && p.steps) {
    frac = p.step / p.steps;
    steps = p.step + ' of ' + p.steps + (p.epochs ? ' · epoch ' + p.epoch + ' of ' + p.epochs : '');
  }
  $('doc-stage').textContent = stage;
  $('doc-steps').textContent = steps;
  const pct = Math.round(frac * 1000) / 10;
  $('progress-fill').style.width = pct + '%';
  $('progress').setAttribute('aria-valuenow', String(pct));
  $('progress').dataset.value = String(pct);
  $('progress').classList.toggle('indeterminate', !TERMINAL.has(d.status) && frac === 0);
  // One loss everywhere: the last step's while training; once absorbed, the figures' final loss.
  const final = d.training && typeof d.training.final_loss === 'number' ? d.training.final_loss : null;
  $('stat-loss-label').textContent = final !== null ? 'final loss' : 'last step loss';
  $('stat-loss').textContent = final !== null ? final.toFixed(4)
    : typeof p.loss === 'number' ? p.loss.toFixed(4) : (pts.length ? pts[pts.length - 1][1].toFixed(4) : '–');
  $('stat-tps').textContent = typeof p.tokens_per_s === 'number' ? fmtNum(p.tokens_per_s) : (d.training && d.training.tokens_per_s ? fmtNum(d.training.tokens_per_s) : '–');
  // Time left: the step rate seen in this stage once training runs; the server's estimate before.
  let eta = '';
  const r = state.rate.get(d.id);
  if (d.status === 'ready') eta = d.training && d.training.total_seconds ? 'took ' + fmtSecs(d.training.total_seconds) : '';
  else if (!TERMINAL.has(d.status) && p.stage === 'training' && r && r.stage === p.stage && r.s > r.s0 && p.steps) {
    eta = 'about ' + fmtSecs((r.t - r.t0) / 1000 / (r.s - r.s0) * (p.steps - p.step)) + ' left';
  } else if (!TERMINAL.has(d.status) && posted && posted.estimate) {
    const left = posted.estimate.seconds - (performance.now() - posted.at) / 1000;
    eta = left > 0 ? 'about ' + fmtSecs(left) + ' left (estimate)' : 'any moment now (estimate passed)';
  }
  $('stat-eta').textContent = eta;
  const t0 = state.started.get(d.id);
  $('stat-elapsed').textContent = d.training && d.training.total_seconds ? fmtSecs(d.training.total_seconds)
    : t0 && !TERMINAL.has(d.status) ? fmtSecs((performance.now() - t0) / 1000) : '–';
  $('live-note').textContent = d.status === 'ready' ? ''
    : d.reabsorbing ? d.reabsorbing.message
    : d.status === 'damaged' ? 'Questions are refused until it is absorbed again.'
    : TERMINAL.has(d.status) ? 'No adapter: answers read the passages that match each question.'
    : 'Until the adapter exists, questions are answered from the passages that match them; a snapshot of the adapter answers once training has one.';
  renderWarnings($('doc-warnings'), posted ? posted.warnings : []);
  drawSpark(pts, p.stage === 'training' ? p.steps : (d.training && d.training.steps) || 0);
}

// The loss curve, small, beside the bar (the numbers are in "Training details").
function drawSpark(pts, steps) {
  const c = $('loss-canvas');
  c.dataset.points = String(pts.length);
  c.hidden = pts.length === 0;
  const dpr = window.devicePixelRatio || 1;
  const w = c.clientWidth || 140, h = c.clientHeight || 34;
  if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
    c.width = Math.round(w * dpr);
    c.height = Math.round(h * dpr);
  }
  const g = c.getContext('2d');
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  if (!pts.length) return;
  let lo = Infinity, hi = -Infinity;
  for (const [, l] of pts) { lo = Math.min(lo, l); hi = Math.max(hi, l); }
  if (hi - lo < 1e-6) { hi += 0.5; lo -= 0.5; }
  const s1 = Math.max(pts[pts.length - 1][0], steps || 0, 1);
  const x = (s) => 2 + (w - 4) * s / s1;
  const y = (l) => 3 + (h - 6) * (1 - (l - lo) / (hi - lo));
  const css = getComputedStyle(document.documentElement);
  g.strokeStyle = css.getPropertyValue('--accent').trim() || '#4f46e5';
  g.lineWidth = 1.5;
  g.lineJoin = 'round';
  g.beginPath();
  pts.forEach(([s, l], i) => (i ? g.lineTo(x(s), y(l)) : g.moveTo(x(s), y(l))));
  g.stroke();
  c.title = 'loss by step: ' + pts[0][1].toFixed(3) + ' → ' + pts[pts.length - 1][1].toFixed(3);
}

const LABELS = {
  kind: 'adapter', parameters: 'parameters', bytes: 'size',
  steps: 'optimizer steps', qa_pairs: 'QA pairs', segments: 'segments', train_seconds: 'training time',
  total_seconds: 'total time', final_loss: 'final loss', tokens_per_s: 'training tokens/s',
  format: 'format', filename: 'file', media_type: 'media type', characters: 'characters', pages: 'pages', extraction: 'extraction',
};

function figure(dl, label, value, testid) {
  const wrap = el('div', 'fig');
  if (testid) wrap.dataset.testid = testid;
  wrap.append(el('dt', null, label), el('dd', null, value));
  dl.append(wrap);
}

function fmtField(k, v) {
  if (Array.isArray(v)) {
    const xs = v.slice(0, 6).map((x) => (typeof x === 'number' ? fmtNum(x) : JSON.stringify(x)));
    return xs.join(', ') + (v.length > 6 ? ', … (' + v.length + ')' : '');
  }
  if (typeof v === 'boolean') return v ? 'yes' : 'no';
  if (typeof v !== 'number') return typeof v === 'object' ? JSON.stringify(v).slice(0, 120) : String(v);
  if (k === 'bytes') return fmtBytes(v);
  if (k.endsWith('_seconds')) return fmtSecs(v);
  if (k === 'final_loss' || k.endsWith('loss')) return v.toFixed(4);
  return fmtNum(v);
}

function renderFigures(d) {
  const dl = $('figures');
  dl.replaceChildren();
  const group = (name, obj, prefix) => {
    if (!obj || typeof obj !== 'object') return;
    dl.append(el('h3', 'figgroup', name));
    for (const [k, v] of Object.entries(obj)) {
      if (v === null || v === undefined) continue;
      figure(dl, LABELS[k] || k.replace(/_/g, ' '), fmtField(k, v), prefix + '-' + k);
    }
  };
  const src = d.source ? Object.assign({}, d.source) : null;
  group('Adapter', d.adapter, 'adapter');
  group('Training', d.training, 'training');
  group('Source', src, 'source');
  const when = el('h3', 'figgroup', 'Document');
  dl.append(when);
  figure(dl, 'tokens', fmtNum(d.tokens), 'doc-tokens');
  figure(dl, 'created', fmtTime(d.created_at), 'doc-created');
  if (d.ready_at) figure(dl, 'ready', fmtTime(d.ready_at), 'doc-ready');
  dl.hidden = false;
}

// ---------- the conversation ----------

function setMode(m) {
  state.mode = m;
  renderModes();
}

// The mode buttons: one pressed, or (comparing) none, with the help line saying what is asked.
function renderModes() {
  const compare = $('compare').checked;
  for (const b of document.querySelectorAll('.modes .mode')) {
    const on = !compare && b.dataset.mode === state.mode;
    b.setAttribute('aria-pressed', String(on));
    b.classList.toggle('dim', compare);
  }
  $('mode-help').textContent = compare
    ? 'Each question is answered four ways, side by side: ' + MODES.map((m) => MODE_NAME[m]).join(', ') + '.'
    : MODE_HELP[state.mode];
}

function renderAskState() {
  const d = state.view;
  $('ask-button').disabled = !d || state.asking;
  $('question').disabled = !d;
  $('ask-hint').textContent = !d ? 'Select a document to ask about it.'
    : d.status === 'ready' ? 'Enter sends, Shift+Enter starts a new line. Answers are greedy (temperature 0).'
    : 'Ask now: until the adapter is ready, answers read the passages (or a snapshot of the adapter once training has one).';
}

// Which adapter answered: 'none', 'snapshot' (part-way through training) or 'final'. A run that
// stopped early (until learned) saves fewer steps than planned: the document's status tells.
function adapterKind(v, docId) {
  const a = v.adapter;
  if (!a) return 'none';
  const d = state.docs.find((x) => x.id === docId);
  return a.step >= a.planned_steps || (d && d.status === 'ready') ? 'final' : 'snapshot';
}

// Who answered, in words: the response's `mode` and `adapter` (`askedMode`: what was asked; a
// `lift` question answered as `rag` had no adapter to use yet), and where self-gating kept the
// answer the passages alone gave (`answered_by`), that it did.
function answeredBy(v, kind, askedMode) {
  const a = v.adapter;
  const adapter = kind === 'snapshot' ? 'adapter snapshot, step ' + a.step + ' of ' + a.planned_steps
    : kind === 'final' ? 'absorbed adapter (' + a.step + ' steps)'
    : askedMode === 'lift' ? (v.notice ? 'no adapter over this base yet' : 'no adapter yet') : 'base model, no adapter';
  const kept = v.answered_by === 'passages' ? ' · the passages’ own answer, the surer one' : '';
  return MODE_NAME[v.mode] + ' · ' + adapter + kept;
}

function newTurn(question, modes) {
  // Only the newest turn carries the stable ids the tests use.
  for (const old of document.querySelectorAll('#thread .turn [id]')) old.removeAttribute('id');
  const turn = el('article', 'turn');
  turn.dataset.testid = 'turn';
  const q = el('div', 'msg user', question);
  q.dataset.testid = 'question';
  turn.append(q);
  const cols = el('div', 'answers cols-' + modes.length);
  const out = {};
  for (const m of modes) {
    const col = el('div', 'msg bot');
    col.id = 'answer-' + m;
    col.dataset.mode = m;
    col.dataset.state = 'waiting';
    col.dataset.testid = 'answer';
    if (modes.length > 1) col.append(el('div', 'who', MODE_NAME[m]));
    const text = el('div', 'atext pending', '');
    text.id = 'answer-' + m + '-text';
    const meta = el('div', 'ameta muted small', 'waiting…');
    col.append(text, meta);
    cols.append(col);
    out[m] = { col, text, meta };
  }
  turn.append(cols);
  $('thread').append(turn);
  $('thread-empty').hidden = true;
  turn.scrollIntoView({ block: 'end' });
  return out;
}

// A follow-up is asked with the conversation so far, so that "When did it open?" is read (and
// its passages chosen) after the question it follows. At most this many earlier turns (questions
// and answers) and characters are sent, the oldest left out first: the server counts them with
// the question against its question limit.
const HISTORY_TURNS = 8;
const HISTORY_CHARS = 4000;

// The thread's turns so far as chat turns for a follow-up asked in `mode`: each question, then
// the answer given in that mode (when the turn was not asked in it, the first answer the turn has).
function historyFor(mode) {
  const turns = [];
  for (const t of $('thread').querySelectorAll(':scope > .turn')) {
    const q = t.querySelector('.msg.user');
    if (!q) continue;
    turns.push({ role: 'user', content: q.textContent });
    const done = [...t.querySelectorAll('.msg.bot[data-state="done"]')];
    const a = done.find((c) => c.dataset.mode === mode) || done[0];
    const text = a ? a.querySelector('.atext').textContent.trim() : '';
    if (text) turns.push({ role: 'assistant', content: text });
  }
  const chars = () => turns.reduce((n, t) => n + t.content.length, 0);
  while (turns.length && (turns.length > HISTORY_TURNS || chars() > HISTORY_CHARS || turns[0].role !== 'user')) turns.shift();
  return turns;
}

async function askOne(docId, question, mode, maxTokens, ui, history) {
  ui.col.dataset.state = 'streaming';
  ui.meta.textContent = 'thinking…';
  const t0 = performance.now();
  let got = false, pieces = 0;
  try {
    const body = { ...target(docId), question, mode, max_tokens: maxTokens, temperature: 0, stream: true };
    if (history.length) body.history = history;
    const resp = await check(await fetch('/ask', {
      method: 'POST',
      headers: headers({ 'Content-Type': 'application/json', Accept: 'text/event-stream' }),
      body: JSON.stringify(body),
    }));
    await readSSE(resp, (name, data) => {
      const v = JSON.parse(data);
      if (name === 'token') {
        ui.text.classList.remove('pending');
        ui.text.textContent += v.text;
        ui.col.dataset.pieces = String(++pieces);
      } else if (name === 'answer') {
        got = true;
        ui.text.classList.remove('pending');
        ui.text.textContent = v.answer;
        renderAnswerMeta(ui, v, { docId, question, history, mode, wallMs: performance.now() - t0 });
        ui.col.dataset.state = 'done';
        ui.col.scrollIntoView({ block: 'nearest' });
      } else if (name === 'error') {
        got = true;
        throw new ApiError(500, v);
      }
    });
    if (!got) throw new Error('the answer stream ended early');
  } catch (e) {
    ui.text.classList.remove('pending');
    ui.meta.replaceChildren();
    // Before the first adapter snapshot, "Absorbed only" has nothing to answer with: not an error.
    if (e instanceof ApiError && e.code === 'document_not_ready') {
      ui.col.dataset.state = 'unavailable';
      ui.text.textContent = 'Not yet: nothing is absorbed so far. Ask again once training has a snapshot.';
      return;
    }
    ui.col.dataset.state = 'error';
    ui.meta.append(el('span', 'err', e instanceof ApiError ? e.message + ' [' + e.code + ']' : 'network error — ' + e.message));
    showError(e, 'Ask (' + MODE_NAME[mode] + ')');
  }
}

// The field naming what is asked: a document, or a collection.
function target(id) {
  return isCollection(id) ? { collection_id: id } : { document_id: id };
}

// A collection's answer names its sources: the documents read, the one whose adapter answered.
function sourcesLine(v) {
  const docs = (v.collection && v.collection.documents) || [];
  const by = v.adapter && v.adapter.document_id;
  const name = (d) => d.title || d.id;
  const s = el('span', 'sources', 'Sources: ' + docs.map(name).join(', ') +
    (by ? ' · adapter of ' + name(docs.find((d) => d.id === by) || { id: by }) : ''));
  s.dataset.testid = 'sources';
  s.dataset.documents = docs.map((d) => d.id).join(' ');
  return s;
}

function renderAnswerMeta(ui, v, asked) {
  ui.meta.replaceChildren();
  const kind = isCollection(asked.docId) ? (v.adapter ? 'final' : 'none') : adapterKind(v, asked.docId);
  const by = el('span', 'by', answeredBy(v, kind, asked.mode));
  by.dataset.testid = 'answered-by';
  by.dataset.mode = v.mode;
  by.dataset.adapter = kind;
  ui.meta.append(by);
  if (v.collection) ui.meta.append(sourcesLine(v));
  const u = v.usage || {};
  ui.meta.append(el('span', 'nums', (u.completion_tokens || 0) + ' tokens · ' + fmtSecs(asked.wallMs / 1000)));
  ui.meta.title = 'prompt ' + (u.prompt_tokens || 0) + ' tokens · queued ' + Math.round((v.timings || {}).queue_ms || 0) + ' ms · finish: ' + v.finish_reason;
  // The passages it read, fetched when opened (answers do not carry them unless asked).
  if (v.mode !== 'memory') ui.col.append(passagesBox(asked));
}

function passagesBox(asked) {
  const det = el('details', 'chunks');
  det.dataset.testid = 'passages';
  const sum = el('summary', null, 'Passages read');
  det.append(sum);
  const box = el('div', 'passages muted small', 'loading…');
  det.append(box);
  det.addEventListener('toggle', async () => {
    if (!det.open || det.dataset.loaded) return;
    det.dataset.loaded = 'loading';
    try {
      const body = { ...target(asked.docId), question: asked.question, mode: asked.mode,
        max_tokens: 1, temperature: 0, include_context: true };
      // The same conversation, so that these are the passages the answer read.
      if (asked.history.length) body.history = asked.history;
      const r = await api('POST', '/ask', body);
      const chunks = (r.data.context && r.data.context.chunks) || [];
      box.replaceChildren();
      box.classList.remove('muted', 'small');
      if (!chunks.length) box.append(el('span', 'muted small', 'This server reports no passages (it has no prepared base with a relevance filter).'));
      else {
        const rel = chunks.filter((c) => c.score > 0).length;
        sum.textContent = 'Passages read: ' + chunks.length + ', ' + rel + ' marked relevant';
        box.append(renderChunks(chunks, asked.docId));
      }
      det.dataset.loaded = 'done';
    } catch (e) {
      det.dataset.loaded = '';
      box.textContent = 'could not load the passages';
      showError(e, 'Passages');
    }
  });
  return det;
}

// The passages, highlighted by the relevance filter's score (positive: relevant); a click opens
// one in its document. `askedId`: the document asked (a collection's passages name their own).
function renderChunks(chunks, askedId) {
  const box = el('div', 'chunklist');
  const max = Math.max(1e-6, ...chunks.map((c) => Math.abs(c.score)));
  for (const c of chunks) {
    // A collection's passages are labelled with their document.
    const docId = c.document_id || askedId;
    const doc = [...state.docs, ...state.cols].find((x) => x.id === docId);
    const title = (doc && doc.title) || docId;
    const s = el('span', 'chunk ' + (c.score > 0 ? 'rel' : 'irr'), (c.document_id ? '[' + title + '] ' : '') + c.text);
    s.dataset.testid = 'chunk';
    s.dataset.score = String(c.score);
    s.dataset.document = docId;
    const a = c.score > 0 ? 0.12 + 0.6 * Math.min(1, c.score / max) : 0;
    s.style.setProperty('--a', a.toFixed(3));
    s.title = 'relevance ' + c.score.toFixed(3) + ' · mask ' + (typeof c.mask === 'number' ? c.mask.toFixed(3) : c.mask) +
      ' · tokens ' + c.start + '–' + c.end + ' · click to open it in ' + title;
    s.setAttribute('role', 'button');
    s.tabIndex = 0;
    const open = () => openPassage(docId, title, c.text);
    s.addEventListener('click', open);
    s.addEventListener('keydown', (e) => { if (e.key === 'Enter' || e.key === ' ') { e.preventDefault(); open(); } });
    box.append(s);
  }
  return box;
}

// Documents' texts, fetched once each (GET /documents/{id}/text).
const docTexts = new Map();

// Opens a passage in its document: the whole text, the passage marked and scrolled to.
async function openPassage(docId, title, passage) {
  const view = $('passage-view');
  const box = $('passage-text');
  $('passage-title').textContent = title;
  box.replaceChildren(el('span', 'muted small', 'loading…'));
  if (!view.open) view.showModal();
  try {
    if (!docTexts.has(docId)) {
      const resp = await check(await fetch('/documents/' + encodeURIComponent(docId) + '/text', { headers: headers() }));
      docTexts.set(docId, await resp.text());
    }
    const text = docTexts.get(docId);
    // A passage is the decoded text of its tokens: found as it is, or without its edge spaces.
    let at = text.indexOf(passage), len = passage.length;
    if (at < 0) { const p = passage.trim(); at = text.indexOf(p); len = p.length; }
    box.replaceChildren();
    if (at < 0) {
      box.append(el('p', 'muted small', 'This passage is not found as such in the text.'), document.createTextNode(text));
      return;
    }
    const mark = el('mark', null, text.slice(at, at + len));
    mark.dataset.testid = 'passage-mark';
    box.append(document.createTextNode(text.slice(0, at)), mark, document.createTextNode(text.slice(at + len)));
    mark.scrollIntoView({ block: 'center' });
  } catch (e) {
    box.textContent = 'could not load the document';
    showError(e, 'Open passage');
  }
}

async function ask(ev) {
  ev.preventDefault();
  const d = state.view;
  const question = $('question').value.trim();
  if (!d || state.asking) return;
  if (!question) { toast('Type a question first.', 'empty_question'); return; }
  // A collection answers in lift and rag only.
  const allowed = isCollection(d.id) ? ['lift', 'rag'] : MODES;
  const modes = $('compare').checked ? allowed : [allowed.includes(state.mode) ? state.mode : 'lift'];
  const maxTokens = Number($('max-tokens').value) || undefined;
  $('question').value = '';
  // The conversation before this question, per mode (taken before its turn joins the thread).
  const histories = Object.fromEntries(modes.map((m) => [m, historyFor(m)]));
  const uis = newTurn(question, modes);
  state.asking = true;
  renderAskState();
  try {
    // One after another: the server queues them anyway, and each answer streams in turn.
    for (const m of modes) await askOne(d.id, question, m, maxTokens, uis[m], histories[m]);
  } finally {
    state.asking = false;
    renderAskState();
    $('question').focus();
  }
}

function initAsk() {
  $('ask-form').addEventListener('submit', ask);
  $('question').addEventListener('keydown', (ev) => {
    if (ev.key === 'Enter' && !ev.shiftKey && !ev.isComposing) ask(ev);
  });
  for (const b of document.querySelectorAll('.modes .mode')) {
    b.title = MODE_HELP[b.dataset.mode];
    b.addEventListener('click', () => { $('compare').checked = false; setMode(b.dataset.mode); });
  }
  $('compare').addEventListener('change', renderModes);
  renderModes();
  // The passage view closes with its button, Escape (the dialog's own) or a click beside it.
  const view = $('passage-view');
  $('passage-close').addEventListener('click', () => view.close());
  view.addEventListener('click', (e) => { if (e.target === view) view.close(); });
}

// ---------- start ----------

function init() {
  initKey();
  initUpload();
  initAsk();
  $('refresh').addEventListener('click', loadList);
  window.addEventListener('resize', () => { if (state.view) renderDoc(); });
  // A tick for the elapsed time and the estimate's countdown while a selected document trains.
  setInterval(() => { if (state.view && !TERMINAL.has(state.view.status)) renderDoc(); }, 1000);
  window.addEventListener('unhandledrejection', (ev) => showError(ev.reason));
  renderDoc();
  loadList();
}

// Anything the page's security policy blocks is a bug of the page: say so.
document.addEventListener('securitypolicyviolation', (ev) => toast('blocked by the security policy: ' + ev.violatedDirective, 'csp_violation'));
document.addEventListener('DOMContentLoaded', init);
