// lift-serve's page: upload a document, follow its absorption live, ask about it.
// Vanilla JS, no build step. Server text is always set through textContent, never parsed as markup.
'use strict';

const $ = (id) => document.getElementById(id);
const KEY_STORE = 'lift-serve.key';
const MODES = ['lift', 'rag', 'icl', 'memory'];
const MODE_INFO = {
  lift: 'absorbed + the passages that matter',
  rag: 'the passages that matter, no adapter',
  icl: 'head and tail of the document, no adapter',
  memory: 'absorbed only, no document text',
};
const TERMINAL = new Set(['ready', 'failed', 'cancelled']);

const state = {
  docs: [],            // last GET /documents
  selected: null,      // selected document id
  view: null,          // latest Document of the selected one
  follow: null,        // AbortController of the selected document's event stream
  loss: new Map(),     // id -> [[step, loss]], from training progress events
  rate: new Map(),     // id -> {stage, t0, s0, t, s}: observed step rate for the ETA
  started: new Map(),  // id -> time the page first saw it training
  file: null,          // the file chosen or dropped
  tab: 'file',
  listTimer: 0,
  asking: false,
  turns: new Map(),    // id -> the answer panels of a document not shown now
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

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const k = key();
  if (k) h.Authorization = 'Bearer ' + k;
  return h;
}

// Throws ApiError for any non-2xx answer (after showing the key prompt on 401).
async function check(resp) {
  if (resp.ok) return resp;
  let body = null;
  try { body = await resp.json(); } catch (_) { /* not JSON */ }
  if (resp.status === 401) needKey(true);
  throw new ApiError(resp.status, body);
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

function needKey(show) {
  $('auth-prompt').hidden = !show;
  document.body.classList.toggle('needs-key', show);
  if (show) $('key-input').focus();
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
  $('key-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const k = $('key-input').value.trim();
    if (k) localStorage.setItem(KEY_STORE, k); else localStorage.removeItem(KEY_STORE);
    needKey(false);
    toast(k ? 'Key saved in this browser.' : 'Key cleared.', null, 'info');
    loadList();
    if (state.selected) select(state.selected, true);
  });
}

// ---------- upload ----------

function setTab(tab) {
  state.tab = tab;
  for (const t of ['file', 'paste']) {
    $('tab-' + t).classList.toggle('active', t === tab);
    $('tab-' + t).setAttribute('aria-selected', String(t === tab));
    $('pane-' + t).hidden = t !== tab;
  }
}

function setFile(f) {
  state.file = f || null;
  $('drop-text').textContent = f ? f.name + ' · ' + fmtBytes(f.size) : '';
  if (!f) {
    $('drop-text').append('Drop a file here or ', el('u', null, 'choose one'));
  }
  $('drop-zone').classList.toggle('has-file', !!f);
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
    if (e1 === null || e2 === null) throw new Error('set both epoch numbers (segments, with QA) or neither');
    o.epochs = [e1, e2];
  }
  const q = int('opt-aux-qa');
  if (q !== null) o.aux_qa = q;
  // Absorb until learned: held-aside probe questions decide when training stops.
  const schedule = $('opt-schedule').value;
  if (schedule) o.until_learned = schedule === 'until_learned';
  return Object.keys(o).length ? o : null;
}

async function submitDoc(ev) {
  ev.preventDefault();
  let options;
  try { options = absorbOptions(); } catch (e) { toast(e.message, 'invalid_options'); return; }
  const title = $('doc-title').value.trim();
  let body;
  if (state.tab === 'file') {
    if (!state.file) { toast('Choose or drop a file first (or paste text).', 'no_file'); return; }
    body = new FormData();
    body.append('file', state.file, state.file.name);
    if (title) body.append('title', title);
    if (options) body.append('options', JSON.stringify(options));
  } else {
    body = { text: $('paste-text').value };
    if (title) body.title = title;
    if (options) body.options = options;
  }
  const btn = $('submit-doc');
  btn.disabled = true;
  btn.textContent = 'Sending…';
  try {
    const r = await api('POST', '/documents', body);
    const d = r.data;
    toast(r.status === 200 ? 'Already known: the same document with the same options.' : 'Queued for absorption.', null, 'info');
    if (state.tab === 'file') { setFile(null); $('file-input').value = ''; } else $('paste-text').value = '';
    $('doc-title').value = '';
    upsert(d);
    select(d.id);
  } catch (e) {
    showError(e, 'Upload');
  } finally {
    btn.disabled = false;
    btn.textContent = 'Absorb document';
  }
}

function initUpload() {
  $('tab-file').addEventListener('click', () => setTab('file'));
  $('tab-paste').addEventListener('click', () => setTab('paste'));
  $('file-input').addEventListener('change', (ev) => setFile(ev.target.files[0]));
  const zone = $('drop-zone');
  const over = (on) => (ev) => { ev.preventDefault(); zone.classList.toggle('over', on); };
  zone.addEventListener('dragenter', over(true));
  zone.addEventListener('dragover', over(true));
  zone.addEventListener('dragleave', over(false));
  zone.addEventListener('drop', (ev) => {
    over(false)(ev);
    const f = ev.dataTransfer && ev.dataTransfer.files[0];
    if (f) { setTab('file'); setFile(f); }
  });
  // A file dropped elsewhere on the page must not navigate away from it.
  window.addEventListener('dragover', (ev) => ev.preventDefault());
  window.addEventListener('drop', (ev) => ev.preventDefault());
  $('upload-form').addEventListener('submit', submitDoc);
  setFile(null);
}

// ---------- document list ----------

async function loadList() {
  clearTimeout(state.listTimer);
  state.listTimer = 0;
  try {
    const r = await api('GET', '/documents');
    state.docs = r.data.data || [];
    needKey(false);
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

function renderList() {
  const ul = $('doc-list');
  ul.replaceChildren();
  $('doc-empty').hidden = state.docs.length > 0;
  for (const d of state.docs.slice().reverse()) {
    const li = el('li', 'docrow' + (d.id === state.selected ? ' selected' : ''));
    li.dataset.id = d.id;
    li.dataset.status = d.status;
    li.dataset.testid = 'doc-row';
    li.tabIndex = 0;
    const main = el('div', 'docmain');
    main.append(el('span', 'doctitle', d.title || d.id));
    const meta = el('span', 'docmeta muted small');
    meta.append(fmtNum(d.tokens) + ' tokens · ' + fmtTime(d.created_at));
    if (d.adapter) meta.append(' · ' + fmtBytes(d.adapter.bytes));
    main.append(meta);
    const badge = el('span', 'badge ' + d.status, d.status);
    if (d.status === 'training' && d.progress && d.progress.steps) {
      badge.textContent = 'training ' + Math.round(100 * d.progress.step / d.progress.steps) + '%';
    }
    const del = el('button', 'btn ghost small danger', 'Delete');
    del.type = 'button';
    del.dataset.testid = 'delete';
    del.title = 'delete this document and its adapter';
    del.addEventListener('click', (ev) => { ev.stopPropagation(); remove(d); });
    li.append(main, badge, del);
    li.addEventListener('click', () => select(d.id));
    li.addEventListener('keydown', (ev) => { if (ev.key === 'Enter') select(d.id); });
    ul.append(li);
  }
}

async function remove(d) {
  if (!confirm('Delete “' + (d.title || d.id) + '”? Its adapter is removed from the server.')) return;
  try {
    await api('DELETE', '/documents/' + encodeURIComponent(d.id));
    state.docs = state.docs.filter((x) => x.id !== d.id);
    state.loss.delete(d.id);
    state.turns.delete(d.id);
    if (state.selected === d.id) select(null);
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
  // Each document keeps its own questions and answers.
  const box = $('turns');
  if (state.selected && state.docs.some((d) => d.id === state.selected)) state.turns.set(state.selected, [...box.children]);
  box.replaceChildren(...(state.turns.get(id) || []));
  state.selected = id;
  state.view = id ? state.docs.find((d) => d.id === id) || null : null;
  renderList();
  renderDoc();
  if (id) follow(id);
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
          const d = JSON.parse(data);
          onProgress(d);
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
  tokenizing: 'Tokenizing',
  generating_qa: 'Generating QA pairs',
  training: 'Training the adapter',
  saving: 'Saving the adapter',
};

function renderDoc() {
  const d = state.view;
  const status = $('doc-status');
  $('figures').hidden = true;
  $('doc-error').hidden = true;
  $('doc-hint').hidden = !!d;
  if (!d) {
    $('doc-heading').textContent = 'Absorption';
    status.textContent = 'no document selected';
    status.className = 'badge';
    status.dataset.status = '';
    $('doc-id').textContent = '';
    $('doc-live').hidden = true;
    renderAskState();
    return;
  }
  $('doc-heading').textContent = d.title || 'Absorption';
  status.textContent = d.status;
  status.className = 'badge ' + d.status;
  status.dataset.status = d.status;
  $('doc-id').textContent = d.id + ' · ' + fmtNum(d.tokens) + ' tokens';
  const pts = state.loss.get(d.id) || [];
  const live = !TERMINAL.has(d.status) || pts.length > 0;
  $('doc-live').hidden = !live;
  if (live) renderLive(d, pts);
  if (d.status === 'failed' || (d.error && d.error.message)) {
    $('doc-error').hidden = false;
    $('doc-error').textContent = 'Absorption failed: ' + ((d.error && d.error.message) || 'no reason given');
  }
  if (d.status === 'ready') renderFigures(d);
  renderAskState();
}

function renderLive(d, pts) {
  const p = d.progress || {};
  let frac = 0;
  let stage = STAGES[p.stage] || (d.status === 'queued' ? 'Waiting in the queue' : d.status === 'ready' ? 'Done' : d.status);
  let steps = '';
  if (d.status === 'ready') frac = 1;
  else if (typeof p.step === 'number' && p.steps) {
    frac = p.step / p.steps;
    steps = 'step ' + p.step + ' / ' + p.steps;
    if (p.epochs) steps += ' · epoch ' + p.epoch + ' / ' + p.epochs;
  }
  $('doc-stage').textContent = stage;
  $('doc-steps').textContent = steps;
  const pct = Math.round(frac * 1000) / 10;
  $('progress-fill').style.width = pct + '%';
  $('progress').setAttribute('aria-valuenow', String(pct));
  $('progress').dataset.value = String(pct);
  $('progress').classList.toggle('indeterminate', !TERMINAL.has(d.status) && !steps);
  $('stat-loss').textContent = typeof p.loss === 'number' ? p.loss.toFixed(3) : (pts.length ? pts[pts.length - 1][1].toFixed(3) : '–');
  $('stat-tps').textContent = typeof p.tokens_per_s === 'number' ? fmtNum(p.tokens_per_s) : (d.training && d.training.tokens_per_s ? fmtNum(d.training.tokens_per_s) : '–');
  // ETA from the step rate observed in this stage (QA generation is followed by training).
  let eta = d.status === 'ready' ? 'done' : '–';
  const r = state.rate.get(d.id);
  if (!TERMINAL.has(d.status) && r && r.stage === p.stage && r.s > r.s0 && p.steps) {
    const perStep = (r.t - r.t0) / 1000 / (r.s - r.s0);
    eta = fmtSecs(perStep * (p.steps - p.step)) + (p.stage === 'generating_qa' ? ' + training' : '');
  }
  $('stat-eta').textContent = eta;
  const t0 = state.started.get(d.id);
  $('stat-elapsed').textContent = d.training && d.training.total_seconds ? fmtSecs(d.training.total_seconds)
    : t0 && !TERMINAL.has(d.status) ? fmtSecs((performance.now() - t0) / 1000)
    : d.ready_at && d.created_at ? fmtSecs(d.ready_at - d.created_at) : '–';
  drawLoss(pts, p.stage === 'training' ? p.steps : 0);
}

// The loss curve on a canvas, sized for the device's pixel ratio.
function drawLoss(pts, steps) {
  const c = $('loss-canvas');
  c.dataset.points = String(pts.length);
  $('loss-empty').hidden = pts.length > 0;
  const dpr = window.devicePixelRatio || 1;
  const w = Math.max(200, c.clientWidth || 600), h = Math.max(120, c.clientHeight || 180);
  if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
    c.width = Math.round(w * dpr);
    c.height = Math.round(h * dpr);
  }
  const g = c.getContext('2d');
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  const css = getComputedStyle(document.documentElement);
  const ink = css.getPropertyValue('--muted').trim() || '#888';
  const line = css.getPropertyValue('--accent').trim() || '#4f46e5';
  const grid = css.getPropertyValue('--line').trim() || '#ddd';
  const L = 44, R = 10, T = 10, B = 24;
  g.font = '11px system-ui, sans-serif';
  g.strokeStyle = grid;
  g.lineWidth = 1;
  g.beginPath();
  g.moveTo(L, T); g.lineTo(L, h - B); g.lineTo(w - R, h - B);
  g.stroke();
  if (!pts.length) return;
  let lo = Infinity, hi = -Infinity;
  for (const [, l] of pts) { lo = Math.min(lo, l); hi = Math.max(hi, l); }
  if (hi - lo < 1e-6) { hi += 0.5; lo = Math.max(0, lo - 0.5); }
  const pad = (hi - lo) * 0.08;
  lo = lo >= 0 ? Math.max(0, lo - pad) : lo - pad;
  hi += pad;
  const s0 = Math.min(pts[0][0], 0), s1 = Math.max(pts[pts.length - 1][0], steps || 0, s0 + 1);
  const x = (s) => L + (w - L - R) * (s - s0) / (s1 - s0);
  const y = (l) => T + (h - T - B) * (1 - (l - lo) / (hi - lo));
  g.fillStyle = ink;
  g.textAlign = 'right';
  g.textBaseline = 'middle';
  for (let i = 0; i <= 3; i++) {
    const v = lo + (hi - lo) * i / 3;
    g.fillText(v.toFixed(2), L - 6, y(v));
    g.strokeStyle = grid;
    g.beginPath(); g.moveTo(L, y(v)); g.lineTo(w - R, y(v)); g.stroke();
  }
  g.textAlign = 'center';
  g.textBaseline = 'top';
  g.fillText('step ' + s1, w - R - 20, h - B + 6);
  g.fillText(String(s0), L, h - B + 6);
  g.strokeStyle = line;
  g.lineWidth = 2;
  g.lineJoin = 'round';
  g.beginPath();
  pts.forEach(([s, l], i) => (i ? g.lineTo(x(s), y(l)) : g.moveTo(x(s), y(l))));
  g.stroke();
  g.fillStyle = line;
  for (const [s, l] of pts) { g.beginPath(); g.arc(x(s), y(l), 2.5, 0, 2 * Math.PI); g.fill(); }
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

// ---------- asking ----------

function renderAskState() {
  const d = state.view;
  const ready = !!d && d.status === 'ready';
  $('ask-button').disabled = !d || state.asking;
  $('chat-doc').textContent = d ? (d.title || d.id) : '';
  $('ask-hint').textContent = !d ? 'Select a document to ask about it.'
    : ready ? 'Greedy decoding (temperature 0). Ctrl+Enter asks.'
    : 'The document is ' + d.status + ': answers read its passages (with the latest adapter snapshot once training has one) until the adapter is ready.';
}

function newTurn(question, modes) {
  // Only the newest turn carries the stable ids the tests use.
  for (const old of document.querySelectorAll('#turns [id]')) old.removeAttribute('id');
  const turn = el('article', 'turn');
  turn.dataset.testid = 'turn';
  turn.append(el('p', 'q', question));
  const cols = el('div', 'cols cols-' + modes.length);
  const out = {};
  for (const m of modes) {
    const col = el('div', 'col-answer');
    col.id = 'answer-' + m;
    col.dataset.mode = m;
    col.dataset.state = 'waiting';
    const head = el('div', 'ahead');
    head.append(el('span', 'mode-tag ' + m, m), el('span', 'muted small', MODE_INFO[m]));
    const text = el('div', 'atext', '');
    text.id = 'answer-' + m + '-text';
    text.classList.add('pending');
    const meta = el('div', 'ameta muted small', 'waiting…');
    meta.dataset.testid = 'answer-' + m + '-meta';
    col.append(head, text, meta);
    cols.append(col);
    out[m] = { col, text, meta, compare: modes.length > 1 };
  }
  turn.append(cols);
  $('turns').prepend(turn);
  return out;
}

async function askOne(docId, question, mode, maxTokens, ui) {
  ui.col.dataset.state = 'streaming';
  ui.meta.textContent = 'thinking…';
  const t0 = performance.now();
  let got = false, pieces = 0;
  try {
    const body = { document_id: docId, question, mode, max_tokens: maxTokens, temperature: 0, stream: true };
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
        renderAnswerMeta(ui, v, performance.now() - t0);
        ui.col.dataset.state = 'done';
      } else if (name === 'error') {
        got = true;
        throw new ApiError(500, v);
      }
    });
    if (!got) throw new Error('the answer stream ended early');
  } catch (e) {
    ui.col.dataset.state = 'error';
    ui.text.classList.remove('pending');
    const msg = e instanceof ApiError ? e.message + ' [' + e.code + ']' : 'network error — ' + e.message;
    ui.meta.textContent = '';
    ui.meta.append(el('span', 'err', msg));
    showError(e, 'Ask (' + mode + ')');
  }
}

function renderAnswerMeta(ui, v, wallMs) {
  ui.meta.replaceChildren();
  const u = v.usage || {}, t = v.timings || {};
  const gen = t.generate_ms ? (1000 * (u.completion_tokens || 0) / t.generate_ms) : null;
  const parts = [
    [u.prompt_tokens, 'prompt tok'], [u.completion_tokens, 'answer tok'],
    [t.queue_ms, 'ms queued'], [t.prompt_ms, 'ms prompt'], [t.generate_ms, 'ms generating'],
  ];
  for (const [n, label] of parts) {
    if (n === undefined || n === null) continue;
    const s = el('span', 'chip');
    s.append(el('b', null, fmtNum(Math.round(n))), ' ' + label);
    ui.meta.append(s);
  }
  if (gen) { const s = el('span', 'chip'); s.append(el('b', null, fmtNum(gen)), ' tok/s'); ui.meta.append(s); }
  if (v.finish_reason) ui.meta.append(el('span', 'chip', 'finish: ' + v.finish_reason));
  if (v.mode && v.mode !== ui.col.dataset.mode) ui.meta.append(el('span', 'chip', 'answered as ' + v.mode));
  const a = v.adapter;
  const by = !a ? 'no adapter' : a.step < a.planned_steps ? 'adapter snapshot, step ' + a.step + ' of ' + a.planned_steps : 'absorbed adapter';
  const chip = el('span', 'chip', by);
  chip.dataset.testid = 'answered-by';
  ui.meta.append(chip);
  ui.meta.title = 'round trip ' + Math.round(wallMs) + ' ms';
  const chunks = v.context && v.context.chunks;
  if (chunks && chunks.length) ui.col.append(renderChunks(chunks, !ui.compare));
}

// The context passages, highlighted by the FltLM relevance score (positive: relevant).
function renderChunks(chunks, open) {
  const det = el('details', 'chunks');
  det.dataset.testid = 'chunks';
  const rel = chunks.filter((c) => c.score > 0).length;
  det.append(el('summary', null, 'Context: ' + chunks.length + ' passages, ' + rel + ' relevant'));
  const max = Math.max(1e-6, ...chunks.map((c) => Math.abs(c.score)));
  const box = el('div', 'passages');
  for (const c of chunks) {
    const s = el('span', 'chunk ' + (c.score > 0 ? 'rel' : 'irr'), c.text);
    s.dataset.testid = 'chunk';
    s.dataset.score = String(c.score);
    const a = c.score > 0 ? 0.12 + 0.6 * Math.min(1, c.score / max) : 0;
    s.style.setProperty('--a', a.toFixed(3));
    s.title = 'score ' + c.score.toFixed(3) + ' · mask ' + (typeof c.mask === 'number' ? c.mask.toFixed(3) : c.mask) +
      ' · tokens ' + c.start + '–' + c.end;
    box.append(s);
  }
  det.append(box);
  det.open = open;
  return det;
}

async function ask(ev) {
  ev.preventDefault();
  const d = state.view;
  const question = $('question').value.trim();
  if (!d || state.asking) return;
  if (!question) { toast('Type a question first.', 'empty_question'); return; }
  const compare = $('compare').checked;
  const mode = document.querySelector('input[name=mode]:checked').value;
  // Before the adapter exists `memory` has nothing to answer with.
  const modes = compare ? MODES.filter((m) => d.status === 'ready' || m !== 'memory') : [mode];
  const maxTokens = Number($('max-tokens').value) || undefined;
  const uis = newTurn(question, modes);
  state.asking = true;
  renderAskState();
  try {
    // One after another: the server queues them anyway, and each column streams in turn.
    for (const m of modes) await askOne(d.id, question, m, maxTokens, uis[m]);
  } finally {
    state.asking = false;
    renderAskState();
  }
}

function initAsk() {
  $('ask-form').addEventListener('submit', ask);
  $('question').addEventListener('keydown', (ev) => {
    if (ev.key === 'Enter' && (ev.ctrlKey || ev.metaKey)) ask(ev);
  });
}

// ---------- start ----------

function init() {
  initKey();
  initUpload();
  initAsk();
  $('refresh').addEventListener('click', loadList);
  window.addEventListener('resize', () => { if (state.view) renderDoc(); });
  // A tick for the elapsed time while a selected document trains.
  setInterval(() => { if (state.view && !TERMINAL.has(state.view.status)) renderDoc(); }, 1000);
  window.addEventListener('unhandledrejection', (ev) => showError(ev.reason));
  renderDoc();
  loadList();
}

// Anything the page's security policy blocks is a bug of the page: say so.
document.addEventListener('securitypolicyviolation', (ev) => toast('blocked by the security policy: ' + ev.violatedDirective, 'csp_violation'));
document.addEventListener('DOMContentLoaded', init);
