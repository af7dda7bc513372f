// outpost local console: reads /v1/events (Server-Sent Events) and draws
// the daemon's state. Plain JavaScript, no library, nothing from elsewhere.
'use strict';

(function () {
  const SVGNS = 'http://www.w3.org/2000/svg';
  const views = window.outpostViews;
  const shortId = views.shortId;
  const TOKEN_KEY = 'outpost.api_token';
  const WINDOW_MS = 10 * 60 * 1000;

  const EVENT_KINDS = ['track_start', 'zone_enter', 'zone_leave', 'line_cross', 'loiter', 'speeding',
    'zone_occupancy', 'track_end'];
  const EVENTS_SHOWN = 20;

  let points = [];
  let last = null;
  const cards = new Map();
  let cardsSig = '';

  // ---- small helpers -------------------------------------------------

  function $(id) { return document.getElementById(id); }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function field(root, name) { return root.querySelector('[data-field="' + name + '"]'); }

  function set(root, name, text) {
    const f = field(root, name);
    if (f && f.textContent !== text) f.textContent = text;
  }

  function num(n) { return n === null || n === undefined ? '–' : String(Math.round(n)); }

  function rate(x) {
    if (x === null || x === undefined) return '–';
    return x >= 100 ? x.toFixed(0) : x.toFixed(1);
  }

  function us(v) {
    if (v === null || v === undefined) return '–';
    if (v < 1000) return v + ' µs';
    if (v < 1e6) return (v / 1000).toFixed(v < 1e4 ? 2 : 1) + ' ms';
    return (v / 1e6).toFixed(2) + ' s';
  }

  function bytes(b) {
    if (b === null || b === undefined) return '–';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
    return (i === 0 ? b.toFixed(0) : b.toFixed(1)) + ' ' + units[i];
  }

  function age(s) {
    if (s === null || s === undefined) return '–';
    if (s < 90) return s.toFixed(0) + ' s';
    if (s < 5400) return (s / 60).toFixed(0) + ' min';
    if (s < 172800) return (s / 3600).toFixed(1) + ' h';
    return (s / 86400).toFixed(1) + ' d';
  }

  function badge(e, text, kind) {
    if (!e) return;
    e.textContent = text;
    e.className = 'badge ' + kind;
  }

  function clockTime(ts) {
    // RFC 3339 UTC from the daemon; shown in the browser's local time.
    const d = new Date(ts);
    return isNaN(d) ? String(ts || '') : d.toLocaleTimeString();
  }

  // ---- plots ----------------------------------------------------------

  // series: [{cls, values: [[t_ms, v|null], ...]}]; draws the last 10 minutes.
  function plot(svg, series, unit) {
    const W = 300, H = 80, TOP = 14;
    const now = points.length ? points[points.length - 1].t : Date.now();
    const from = now - WINDOW_MS;
    let max = 0, n = 0;
    for (const s of series) {
      for (const [t, v] of s.values) {
        if (t >= from && v !== null && v !== undefined) { max = Math.max(max, v); n++; }
      }
    }
    const top = max > 0 ? max * 1.1 : 1;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const grid = document.createElementNS(SVGNS, 'line');
    grid.setAttribute('x1', '0'); grid.setAttribute('x2', String(W));
    grid.setAttribute('y1', String(H - 0.5)); grid.setAttribute('y2', String(H - 0.5));
    grid.setAttribute('class', 'axis');
    svg.appendChild(grid);
    for (const s of series) {
      let d = '';
      let pen = false;
      for (const [t, v] of s.values) {
        if (t < from) continue;
        if (v === null || v === undefined) { pen = false; continue; }
        const x = ((t - from) / WINDOW_MS) * W;
        const y = H - (v / top) * (H - TOP);
        d += (pen ? 'L' : 'M') + x.toFixed(1) + ' ' + y.toFixed(1);
        pen = true;
      }
      const path = document.createElementNS(SVGNS, 'path');
      path.setAttribute('d', d || 'M0 ' + H);
      path.setAttribute('class', 'line ' + s.cls);
      path.setAttribute('vector-effect', 'non-scaling-stroke');
      svg.appendChild(path);
    }
    const label = svg.parentNode ? svg.parentNode.querySelector('.plotmax') : null;
    if (label) label.textContent = 'peak ' + (unit === 'us' ? us(Math.round(max)) : rate(max) + unit);
    svg.dataset.n = String(n);
    svg.dataset.max = String(max);
  }

  function seriesOf(pick) {
    return points.map(p => [p.t, pick(p)]);
  }

  function drawPlots() {
    for (const [name, c] of cards) {
      const at = i => p => (p.pipelines && p.pipelines[name] ? p.pipelines[name][i] : null);
      plot(c.fps, [{ cls: 'k1', values: seriesOf(at(0)) }, { cls: 'k2', values: seriesOf(at(1)) }], '/s');
      plot(c.p99, [{ cls: 'k3', values: seriesOf(at(2)) }], 'us');
    }
    const backlog = document.querySelector('[data-plot="backlog"]');
    plot(backlog, [
      { cls: 'k1', values: seriesOf(p => p.backlog) },
      { cls: 'k2', values: seriesOf(p => p.acked_per_s) },
    ], '');
  }

  // ---- pipelines -------------------------------------------------------

  function pipelineCard(p) {
    const card = el('article', 'card pipeline');
    card.dataset.pipeline = p.name;
    const head = el('div', 'head');
    head.appendChild(el('h3', null, p.name));
    const state = el('span', 'badge', '–');
    state.dataset.field = 'state';
    head.appendChild(state);
    const ctl = el('button', 'ctl', 'Pause');
    ctl.type = 'button';
    ctl.dataset.field = 'toggle';
    ctl.addEventListener('click', () => {
      const paused = ctl.dataset.paused === 'true';
      act('/v1/pipelines/' + encodeURIComponent(p.name) + (paused ? '/resume' : '/pause'),
        (paused ? 'resume ' : 'pause ') + p.name);
    });
    head.appendChild(ctl);
    card.appendChild(head);

    const meta = el('p', 'meta');
    for (const f of ['source', 'model']) {
      const s = el('span');
      s.dataset.field = f;
      meta.appendChild(s);
    }
    card.appendChild(meta);

    const dl = el('dl');
    const rows = [
      ['frames/s in', 'fps_in', true], ['frames/s out', 'fps_out', true],
      ['frames in', 'frames_in'], ['frames done', 'frames_done'],
      ['records', 'records'], ['queue', 'queue'],
      ['latency p50', 'p50'], ['p90', 'p90'], ['p99', 'p99'], ['max', 'max'],
      ['inference p99', 'inference_p99'], ['drops', 'drops'],
    ];
    for (const [label, name, big] of rows) {
      dl.appendChild(el('dt', null, label));
      const dd = el('dd', big ? 'big' : null, '–');
      dd.dataset.field = name;
      dl.appendChild(dd);
    }
    card.appendChild(dl);

    const plots = el('div', 'plots');
    const fpsFig = el('figure');
    const fps = document.createElementNS(SVGNS, 'svg');
    fps.setAttribute('viewBox', '0 0 300 80');
    fps.setAttribute('preserveAspectRatio', 'none');
    fps.setAttribute('role', 'img');
    fps.setAttribute('aria-label', 'frames per second, last 10 minutes');
    fps.dataset.plot = 'fps';
    fpsFig.appendChild(fps);
    const fcap = el('figcaption');
    fcap.appendChild(el('span', 'key k1'));
    fcap.appendChild(document.createTextNode('in '));
    fcap.appendChild(el('span', 'key k2'));
    fcap.appendChild(document.createTextNode('out, frames/s '));
    fcap.appendChild(el('span', 'plotmax'));
    fpsFig.appendChild(fcap);
    plots.appendChild(fpsFig);
    const p99Fig = el('figure');
    const p99 = document.createElementNS(SVGNS, 'svg');
    p99.setAttribute('viewBox', '0 0 300 80');
    p99.setAttribute('preserveAspectRatio', 'none');
    p99.setAttribute('role', 'img');
    p99.setAttribute('aria-label', 'p99 latency, last 10 minutes');
    p99.dataset.plot = 'p99';
    p99Fig.appendChild(p99);
    const pcap = el('figcaption');
    pcap.appendChild(el('span', 'key k3'));
    pcap.appendChild(document.createTextNode('p99 latency, each second '));
    pcap.appendChild(el('span', 'plotmax'));
    p99Fig.appendChild(pcap);
    plots.appendChild(p99Fig);
    card.appendChild(plots);

    let view = null;
    let events = null;
    if (p.input === 'image') {
      // One picture, or one per camera of a pipeline over several.
      view = views.build(p);
      card.appendChild(view.root);
      if (view.cameras) card.classList.add('many');
    }
    if (p.tracking) {
      card.appendChild(el('h4', null, 'Last tracking events'));
      events = el('ol', 'events');
      events.dataset.field = 'events';
      card.appendChild(events);
    }

    card.appendChild(el('h4', null, 'Latest records'));
    const recs = el('ol', 'records');
    recs.dataset.field = 'records_list';
    card.appendChild(recs);
    const c = {
      card, fps, p99, view, events, seen: new Map(),
    };
    if (events) {
      // The tick carries the newest records only: start from the last ones kept.
      fetch('/v1/pipelines/' + encodeURIComponent(p.name) + '/records')
        .then(r => (r.ok ? r.json() : []))
        .then(recs => { if (cards.get(p.name) === c) { mergeEvents(c, recs); renderEvents(c); } })
        .catch(() => {});
    }
    return c;
  }

  // ---- tracking events ---------------------------------------------------

  // Events of the records, each once (by record id and place), newest first.
  function mergeEvents(c, recs) {
    for (const r of recs || []) {
      const list = r && r.outputs && Array.isArray(r.outputs.events) ? r.outputs.events : [];
      list.forEach((e, i) => {
        if (!e || EVENT_KINDS.indexOf(e.event) < 0) return;
        const key = String(r.id) + '#' + i;
        if (c.seen.has(key)) return;
        const t = Date.parse(e.ts);
        c.seen.set(key, { e, stream: r.stream, t: isNaN(t) ? 0 : t, seq: Number(r.seq) || 0, i });
      });
    }
    const all = Array.from(c.seen.entries());
    all.sort((x, y) => (y[1].t - x[1].t) || (y[1].seq - x[1].seq) || (y[1].i - x[1].i));
    c.seen = new Map(all.slice(0, EVENTS_SHOWN));
  }

  function eventDetail(e) {
    const d = [];
    if (e.zone !== undefined) d.push('zone ' + e.zone);
    if (e.line !== undefined) d.push('line ' + e.line + (e.direction !== undefined ? ' ' + e.direction : ''));
    if (typeof e.dwell_s === 'number') d.push(e.dwell_s.toFixed(1) + ' s');
    if (typeof e.count === 'number') d.push(e.count + ' now (was ' + e.previous + ')');
    if (typeof e.speed === 'number') d.push(e.speed.toFixed(1) + ' ' + String(e.speed_unit || ''));
    if (typeof e.max_speed === 'number') d.push('max ' + e.max_speed.toFixed(1) + ' ' + String(e.speed_unit || ''));
    if (typeof e.speed_limit === 'number') d.push('limit ' + e.speed_limit);
    if (e.reason !== undefined) d.push(String(e.reason));
    if (e.text !== undefined && e.text !== null) d.push('“' + e.text + '”');
    return d.join(', ');
  }

  function renderEvents(c) {
    const list = c.events;
    if (!list) return;
    while (list.firstChild) list.removeChild(list.firstChild);
    if (c.seen.size === 0) {
      list.appendChild(el('li', 'none', 'none yet'));
      return;
    }
    for (const { e } of c.seen.values()) {
      const li = el('li');
      li.dataset.event = String(e.event);
      // A zone's count is the stream's, no track's.
      const track = e.track === undefined ? '' : String(e.track);
      li.dataset.track = track;
      li.dataset.ts = String(e.ts);
      li.title = track;
      li.appendChild(el('span', 'when', clockTime(e.ts)));
      li.appendChild(el('span', 'kind', String(e.event)));
      li.appendChild(el('span', 'track', track ? shortId(track) : ''));
      li.appendChild(el('span', 'label', String(e.label === undefined ? '' : e.label)));
      const detail = eventDetail(e);
      if (detail) li.appendChild(el('span', 'detail', detail));
      list.appendChild(li);
    }
  }

  // A line a person reads: classes with scores, events, box counts; else JSON.
  function summary(o) {
    if (o === null || o === undefined) return '';
    const parts = [];
    if (Array.isArray(o.top)) {
      parts.push(o.top.slice(0, 3).map(t => (t.label !== undefined ? t.label : t.index) +
        (typeof t.score === 'number' ? ' ' + t.score.toFixed(3) : '')).join(', '));
    }
    if (o.event !== undefined) {
      parts.push(String(o.event) + (typeof o.t === 'number' ? ' at ' + o.t.toFixed(2) + ' s' : '') +
        (typeof o.duration_s === 'number' ? ', ' + o.duration_s.toFixed(2) + ' s long' : ''));
    }
    if (Array.isArray(o.events)) {
      parts.push(o.events.map(e => String(e && e.event) + (e && e.track ? ' ' + shortId(e.track) : '')).join(', '));
    }
    for (const k of ['boxes', 'detections', 'faces', 'texts']) {
      if (Array.isArray(o[k])) parts.push(o[k].length + ' ' + k);
    }
    if (o.text !== undefined) parts.push(String(o.text));
    if (o.truncated) parts.push('(' + bytes(o.bytes) + ', too large to show)');
    let s = parts.length ? parts.join('; ') : JSON.stringify(o);
    if (s.length > 140) s = s.slice(0, 139) + '…';
    return s;
  }

  function renderRecords(list, recs) {
    while (list.firstChild) list.removeChild(list.firstChild);
    if (!recs || recs.length === 0) {
      list.appendChild(el('li', 'none', 'none yet'));
      return;
    }
    for (const r of recs) {
      const li = el('li');
      li.appendChild(el('span', 'when', clockTime(r.ts)));
      li.appendChild(el('span', 'stream', r.stream || ''));
      li.appendChild(el('code', null, summary(r.outputs)));
      list.appendChild(li);
    }
  }

  function renderPipelines(status, point, records) {
    const host = $('pipelines');
    const names = status.pipelines.map(p => p.name);
    // A card is built for what its pipeline is: its name, input, tracking
    // and cameras.
    const sig = status.pipelines.map(p => p.name + '\t' + p.input + '\t' + (p.tracking ? 't' : '') +
      '\t' + views.signature(p)).join('\n');
    if (sig !== cardsSig) {
      cardsSig = sig;
      while (host.firstChild) host.removeChild(host.firstChild);
      cards.clear();
      for (const p of status.pipelines) {
        const c = pipelineCard(p);
        cards.set(p.name, c);
        host.appendChild(c.card);
      }
      if (names.length === 0) host.appendChild(el('p', 'none', 'no pipeline runs'));
    }
    for (const p of status.pipelines) {
      const c = cards.get(p.name);
      const card = c.card;
      const live = point && point.pipelines ? point.pipelines[p.name] : null;
      badge(field(card, 'state'), p.paused ? 'paused' : 'running', p.paused ? 'warn' : 'ok');
      const toggle = field(card, 'toggle');
      toggle.textContent = p.paused ? 'Resume' : 'Pause';
      toggle.dataset.paused = String(p.paused);
      set(card, 'source', p.source + (p.source_state ? ' · ' + p.source_state : ''));
      set(card, 'model', p.model + ' · ' + p.provider);
      set(card, 'fps_in', rate(live ? live[0] : null));
      set(card, 'fps_out', rate(live ? live[1] : null));
      set(card, 'frames_in', num(p.frames_in));
      set(card, 'frames_done', num(p.frames_done));
      set(card, 'records', num(p.records));
      set(card, 'queue', num(p.queue_depth) + ' / ' + num(p.queue_capacity));
      const e = p.e2e_latency || {};
      set(card, 'p50', us(e.p50_us));
      set(card, 'p90', us(e.p90_us));
      set(card, 'p99', us(e.p99_us));
      set(card, 'max', us(e.max_us));
      set(card, 'inference_p99', us((p.inference_latency || {}).p99_us));
      const drops = Object.entries(p.drops || {}).filter(([, n]) => n > 0);
      set(card, 'drops', drops.length ? drops.map(([r, n]) => r + ' ' + n).join(', ') : 'none');
      renderRecords(field(card, 'records_list'), records ? records[p.name] : null);
      if (c.view) views.update(c.view, p);
      if (p.tracking && c.events) {
        mergeEvents(c, records ? records[p.name] : null);
        renderEvents(c);
      }
    }
  }

  // ---- the other cards -------------------------------------------------

  function renderOutbox(o) {
    const card = $('outbox');
    set(card, 'records', num(o.records));
    set(card, 'bytes', bytes(o.bytes));
    set(card, 'max_bytes', o.max_bytes ? bytes(o.max_bytes) : 'no limit');
    set(card, 'oldest', o.oldest_age_s === null ? 'none waiting' : age(o.oldest_age_s));
    set(card, 'dead_letters', num(o.dead_letters));
    set(card, 'appended_total', num(o.appended_total));
    set(card, 'acked_total', num(o.acked_total));
    if (o.read_only) {
      // The disk refuses writes: new records wait in memory, up to a bound.
      badge(field(card, 'disk'), 'read-only', 'bad');
      set(card, 'disk_detail', num(o.held_records) + ' held in memory (' + bytes(o.held_bytes) +
        ' of ' + bytes(o.held_max_bytes) + '), ' + num(o.held_dropped_total) + ' dropped' +
        (o.store_closed ? '; disk free to unmount' : ''));
    } else if (o.unavailable) {
      badge(field(card, 'disk'), 'cannot store', 'bad');
      set(card, 'disk_detail', o.unavailable);
    } else {
      badge(field(card, 'disk'), 'storing', 'ok');
      set(card, 'disk_detail', '');
    }
    const share = o.max_bytes ? Math.min(1, o.bytes / o.max_bytes) : 0;
    const fill = field(card, 'fill');
    fill.style.width = (share * 100).toFixed(1) + '%';
    fill.className = share > 0.8 ? 'bad' : share > 0.5 ? 'warn' : 'ok';
  }

  function renderUplink(u, point) {
    const card = $('uplink');
    if (!u) {
      badge(field(card, 'state'), 'none configured', 'idle');
      set(card, 'kind', 'records stay in the outbox');
      for (const f of ['acked_per_s', 'sent_total', 'acked_total', 'retries_total', 'inflight', 'last_error']) {
        set(card, f, '–');
      }
      return;
    }
    badge(field(card, 'state'), u.connected ? 'connected' : 'backing off', u.connected ? 'ok' : 'bad');
    set(card, 'kind', u.kind);
    set(card, 'acked_per_s', rate(point ? point.acked_per_s : null));
    set(card, 'sent_total', num(u.sent_total));
    set(card, 'acked_total', num(u.acked_total));
    set(card, 'retries_total', num(u.retries_total));
    set(card, 'inflight', num(u.inflight));
    set(card, 'last_error', u.last_error ? u.last_error.message + ' (' + age(u.last_error.age_s) + ' ago)' : 'none');
  }

  function renderOta(status) {
    const card = $('ota');
    const o = status.ota;
    set(card, 'daemon', status.daemon.version + ' · slot ' + status.daemon.slot);
    const models = Array.from(new Set(status.pipelines.map(p => p.model + ' (' + p.provider + ')')));
    set(card, 'models', models.length ? models.join(', ') : 'none');
    const steps = field(card, 'steps');
    while (steps.firstChild) steps.removeChild(steps.firstChild);
    if (!o) {
      badge(field(card, 'phase'), 'not configured', 'idle');
      set(card, 'probation', '–');
      return;
    }
    badge(field(card, 'phase'), o.phase, o.phase === 'idle' ? 'ok' : o.phase === 'rolling_back' ? 'bad' : 'warn');
    const prob = [];
    if (o.model_probation) prob.push('new model on probation');
    if (o.daemon_trial) prob.push('daemon slot on trial');
    set(card, 'probation', prob.length ? prob.join(', ') : 'none');
    const recent = (o.recent || []).slice(-8).reverse();
    if (recent.length === 0) steps.appendChild(el('li', 'none', 'no update since the start'));
    for (const s of recent) {
      const text = clockTime(s.ts) + ' ' + s.step + ' ' + s.name + ' ' + s.version +
        (s.from ? ' (from ' + s.from + ')' : '') + (s.detail ? ': ' + s.detail : '');
      steps.appendChild(el('li', /fail|refus|roll/.test(s.step) ? 'bad' : null, text));
    }
  }

  function renderSystem(sys, point) {
    const card = $('system');
    set(card, 'cpu', point && point.cpu !== null && point.cpu !== undefined ? point.cpu.toFixed(0) + ' %' : '–');
    set(card, 'process_cpu', point && point.process_cpu !== null && point.process_cpu !== undefined
      ? point.process_cpu.toFixed(1) + ' % of a core' : '–');
    set(card, 'load1', sys.load1 === null ? '–' : sys.load1.toFixed(2) + ' on ' + sys.cpus + ' CPUs');
    set(card, 'memory', sys.memory_total_bytes
      ? bytes(sys.memory_total_bytes - sys.memory_available_bytes) + ' of ' + bytes(sys.memory_total_bytes) : '–');
    set(card, 'rss', bytes(sys.process_resident_bytes));
    const temps = (sys.temperatures || []).map(t => t.zone.replace(/^thermal_zone\d+:/, '') + ' ' + t.celsius.toFixed(0) + ' °C');
    set(card, 'temperatures', temps.length ? temps.join(', ') : 'not reported');
    const gpus = (sys.gpus || []).map(g => g.name + ' ' + (g.utilization === null ? '–' : g.utilization.toFixed(0) + ' %') +
      (g.memory_total_bytes ? ', ' + bytes(g.memory_used_bytes) + ' of ' + bytes(g.memory_total_bytes) : '') +
      (g.temperature_celsius ? ', ' + g.temperature_celsius.toFixed(0) + ' °C' : ''));
    set(card, 'gpus', gpus.length ? gpus.join('; ') : 'none');
  }

  function renderClock(c) {
    const card = $('clock');
    if (!c) return;
    const why = { behind: 'behind the last known good time', kernel_unsynced: 'not synchronised', ahead: 'far ahead of every trusted reference' };
    badge(field(card, 'state'), c.synced ? 'trusted' : 'not trusted: ' + (why[c.reason] || c.reason), c.synced ? 'ok' : 'bad');
    set(card, 'system', c.system);
    set(card, 'last_good', c.last_good);
    const off = Math.abs(c.offset_s);
    set(card, 'offset', (c.offset_s < 0 ? 'behind by ' : 'ahead by ') +
      (off < 120 ? off.toFixed(1) + ' s' : off < 172800 ? (off / 3600).toFixed(1) + ' h' : (off / 86400).toFixed(0) + ' days'));
    set(card, 'kernel', c.kernel + (c.require_sync ? '' : ' (not required)'));
    set(card, 'last_sync', c.last_sync ? c.last_sync.at + (c.last_sync.step_s === null ? '' : ', step ' + c.last_sync.step_s.toFixed(1) + ' s') : 'none');
    set(card, 'unsynced_records_total', num(c.unsynced_records_total));
    set(card, 'corrected_records_total', num(c.corrected_records_total));
  }

  function render(tick) {
    const s = tick.status;
    $('device').textContent = s.device;
    $('daemon').textContent = 'version ' + s.daemon.version + ' · slot ' + s.daemon.slot + ' · boot ' + s.boot +
      (s.ready ? '' : ' · starting');
    renderPipelines(s, tick.point, tick.records);
    renderOutbox(s.outbox);
    renderUplink(s.uplink, tick.point);
    renderOta(s);
    renderSystem(s.system, tick.point);
    renderClock(s.clock);
    drawPlots();
    document.body.dataset.ticks = String(Number(document.body.dataset.ticks || 0) + 1);
  }

  // ---- the feed -----------------------------------------------------------

  function addPoint(p) {
    points.push(p);
    const from = p.t - WINDOW_MS;
    while (points.length && points[0].t < from) points.shift();
  }

  function connect() {
    const es = new EventSource('/v1/events');
    es.addEventListener('open', () => badge($('conn'), 'live', 'ok'));
    es.addEventListener('history', e => {
      points = JSON.parse(e.data);
      if (last) drawPlots();
    });
    es.addEventListener('tick', e => {
      const t = JSON.parse(e.data);
      if (!points.length || points[points.length - 1].t < t.point.t) addPoint(t.point);
      last = t;
      render(t);
    });
    es.addEventListener('error', () => {
      if (es.readyState === EventSource.CLOSED) {
        // Refused (too many consoles) or gone: try again a little later.
        badge($('conn'), 'disconnected', 'bad');
        es.close();
        setTimeout(connect, 5000);
      } else {
        badge($('conn'), 'reconnecting', 'warn');
      }
    });
  }

  // ---- controls (the API checks the token; the page only carries it) -------

  function token() { return sessionStorage.getItem(TOKEN_KEY) || ''; }

  function showControls() {
    const on = token() !== '';
    $('token-form').hidden = on;
    $('unlocked').hidden = !on;
    document.body.classList.toggle('unlocked', on);
  }

  function result(text, ok) {
    const r = $('action-result');
    r.textContent = text;
    r.className = ok ? 'ok' : 'bad';
  }

  async function act(path, label) {
    let status = 0;
    let body = {};
    try {
      const r = await fetch(path, { method: 'POST', headers: { Authorization: 'Bearer ' + token() } });
      status = r.status;
      try { body = await r.json(); } catch (e) { body = {}; }
    } catch (e) {
      result(label + ': no answer (' + e + ')', false);
      return 0;
    }
    if (status >= 200 && status < 300) {
      result(label + ': done', true);
    } else {
      result(label + ': refused (' + status + (body.error ? ': ' + body.error : '') + ')', false);
    }
    return status;
  }

  function init() {
    $('token-form').addEventListener('submit', e => {
      e.preventDefault();
      const t = $('token').value.trim();
      $('token').value = '';
      if (t) sessionStorage.setItem(TOKEN_KEY, t);
      showControls();
    });
    $('lock').addEventListener('click', () => {
      sessionStorage.removeItem(TOKEN_KEY);
      showControls();
      result('', true);
    });
    $('reload').addEventListener('click', () => act('/v1/reload', 'reload'));
    showControls();
    connect();
  }

  if (document.readyState === 'loading') {
    document.addEventListener('DOMContentLoaded', init);
  } else {
    init();
  }
})();
