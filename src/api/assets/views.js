// outpost local console: a pipeline's picture. The latest frame with the
// zones, lines and live tracks drawn over it; for a pipeline over several
// cameras one such view per camera, side by side, each with its camera's
// figures. Plain JavaScript, no library; console.js uses it through
// `window.outpostViews`.
'use strict';

window.outpostViews = (function () {
  const SVGNS = 'http://www.w3.org/2000/svg';
  const SNAPSHOT_EVERY_MS = 3000;
  const SNAPSHOT_RETRY_MS = 30000;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function set(root, name, text) {
    const f = root.querySelector('[data-field="' + name + '"]');
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

  // ---- overlay: zones, lines and live tracks ---------------------------

  function svgEl(tag, cls, attrs) {
    const e = document.createElementNS(SVGNS, tag);
    if (cls) e.setAttribute('class', cls);
    for (const k of Object.keys(attrs || {})) e.setAttribute(k, String(attrs[k]));
    return e;
  }

  function svgText(cls, x, y, size, text) {
    const t = svgEl('text', cls, { x: x.toFixed(1), y: y.toFixed(1), 'font-size': size.toFixed(1) });
    t.textContent = text;
    return t;
  }

  function finite(...xs) { return xs.every(x => typeof x === 'number' && isFinite(x)); }

  // `{device}/{pipeline}/{stream}/{boot}-{n}`: `{boot}-{n}` tells tracks apart.
  function shortId(id) {
    const s = String(id || '');
    const i = s.lastIndexOf('/');
    return '#' + (i >= 0 ? s.slice(i + 1) : s);
  }

  // A zone's objects now (zones with `occupancy`), per label, of the view's
  // camera, else of the stream whose boxes are drawn, else of all streams:
  // "2 car, 1 person".
  function zoneCounts(t, zone) {
    const occ = t.occupancy || {};
    // A camera's view counts its own stream only.
    const streams = t.stream ? [t.stream]
      : t.live && occ[t.live.stream] ? [t.live.stream] : Object.keys(occ);
    const sum = new Map();
    for (const s of streams) {
      const byLabel = (occ[s] || {})[zone] || {};
      for (const label of Object.keys(byLabel)) {
        const n = Number(byLabel[label]);
        if (isFinite(n)) sum.set(label, (sum.get(label) || 0) + n);
      }
    }
    const parts = [];
    for (const [label, n] of Array.from(sum.entries()).sort()) {
      if (n > 0) parts.push(n + ' ' + label);
    }
    if (parts.length === 0 && sum.size > 0) return '0';
    return parts.join(', ');
  }

  function drawOverlay(c, t) {
    const svg = c.overlay;
    if (!svg) return;
    // The snapshot is the whole source frame: its natural size is the
    // frame's; before it loads, the size the daemon saw.
    let size = null;
    if (c.img && c.img.dataset.kind === 'snapshot' && c.img.naturalWidth > 0) {
      size = [c.img.naturalWidth, c.img.naturalHeight];
    } else if (Array.isArray(t.frame_size) && finite(t.frame_size[0], t.frame_size[1])) {
      size = t.frame_size;
    }
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    if (!size || !(size[0] > 0 && size[1] > 0)) {
      svg.dataset.tracks = '0';
      return;
    }
    const [w, h] = size;
    svg.setAttribute('viewBox', '0 0 ' + w + ' ' + h);
    const fs = Math.max(w, h) / 28;
    const geo = t.geometry || {};
    for (const z of geo.zones || []) {
      const pts = (z.polygon || []).filter(q => Array.isArray(q) && finite(q[0], q[1]));
      if (pts.length < 3) continue;
      const poly = svgEl('polygon', 'zone', {
        points: pts.map(q => q[0] + ',' + q[1]).join(' '),
        'vector-effect': 'non-scaling-stroke',
      });
      poly.dataset.name = String(z.name);
      svg.appendChild(poly);
      const top = pts.reduce((a, q) => (q[1] < a[1] || (q[1] === a[1] && q[0] < a[0]) ? q : a));
      const count = zoneCounts(t, String(z.name));
      const name = svgText('zone-name', top[0] + fs * 0.3, top[1] + fs * 1.1, fs,
        String(z.name) + (count ? ': ' + count : ''));
      name.dataset.name = String(z.name);
      svg.appendChild(name);
    }
    for (const l of geo.lines || []) {
      const [a, b] = l.points || [];
      if (!a || !b || !finite(a[0], a[1], b[0], b[1])) continue;
      const line = svgEl('line', 'line', {
        x1: a[0], y1: a[1], x2: b[0], y2: b[1], 'vector-effect': 'non-scaling-stroke',
      });
      line.dataset.name = String(l.name);
      svg.appendChild(line);
      // "in" is crossing from the left to the right with the first point at
      // the top: the right-hand normal of a->b (y pointing down).
      const dx = b[0] - a[0], dy = b[1] - a[1];
      const len = Math.hypot(dx, dy) || 1;
      const nx = dy / len, ny = -dx / len;
      const mx = (a[0] + b[0]) / 2, my = (a[1] + b[1]) / 2;
      const L = fs * 1.6, hw = fs * 0.5;
      const tip = [mx + nx * L, my + ny * L];
      const back = [mx + nx * L * 0.45, my + ny * L * 0.45];
      const arrow = svgEl('path', 'in-side', {
        d: 'M' + mx.toFixed(1) + ' ' + my.toFixed(1) + 'L' + back[0].toFixed(1) + ' ' + back[1].toFixed(1) +
          'M' + (back[0] - ny * hw).toFixed(1) + ' ' + (back[1] + nx * hw).toFixed(1) +
          'L' + tip[0].toFixed(1) + ' ' + tip[1].toFixed(1) +
          'L' + (back[0] + ny * hw).toFixed(1) + ' ' + (back[1] - nx * hw).toFixed(1) + 'Z',
        'vector-effect': 'non-scaling-stroke',
      });
      arrow.dataset.name = String(l.name);
      svg.appendChild(arrow);
      const inLabel = svgText('in-label', tip[0] + nx * fs * 0.4, tip[1] + ny * fs * 0.4 + fs * 0.35, fs, 'in');
      inLabel.setAttribute('text-anchor', nx > 0.3 ? 'start' : nx < -0.3 ? 'end' : 'middle');
      svg.appendChild(inLabel);
      const first = a[1] <= b[1] ? a : b;
      svg.appendChild(svgText('line-name', first[0] + fs * 0.3, first[1] + fs * 1.1, fs, String(l.name)));
    }
    let n = 0;
    const boxes = t.live && Array.isArray(t.live.boxes) ? t.live.boxes : [];
    for (const bx of boxes) {
      const q = bx.box;
      if (!Array.isArray(q) || !finite(q[0], q[1], q[2], q[3])) continue;
      const rect = svgEl('rect', 'track' + (bx.stationary ? ' stationary' : ''), {
        x: Math.min(q[0], q[2]), y: Math.min(q[1], q[3]),
        width: Math.abs(q[2] - q[0]), height: Math.abs(q[3] - q[1]),
        'vector-effect': 'non-scaling-stroke',
      });
      rect.dataset.track = String(bx.track);
      svg.appendChild(rect);
      const x0 = Math.min(q[0], q[2]), x1 = Math.max(q[0], q[2]), y0 = Math.min(q[1], q[3]);
      const text = shortId(bx.track) + ' ' + String(bx.label === undefined ? '' : bx.label);
      const ty = y0 > fs * 1.2 ? y0 - fs * 0.3 : y0 + fs;
      // Kept inside the frame: near its right edge the label ends at the box's.
      const right = x0 + text.length * fs * 0.62 > w;
      const label = svgText('track-label', right ? x1 : x0, ty, fs, text);
      if (right) label.setAttribute('text-anchor', 'end');
      label.dataset.track = String(bx.track);
      svg.appendChild(label);
      n++;
    }
    svg.dataset.tracks = String(n);
  }


  // ---- snapshots ---------------------------------------------------------

  function placeholder(img, text) {
    const svg = '<svg xmlns="' + SVGNS + '" width="320" height="180" viewBox="0 0 320 180">' +
      '<rect width="320" height="180" fill="#e6e6e6" stroke="#000" stroke-width="2"/>' +
      '<text x="160" y="96" font-family="sans-serif" font-size="18" text-anchor="middle" fill="#000">' +
      text + '</text></svg>';
    img.src = 'data:image/svg+xml;charset=utf-8,' + encodeURIComponent(svg);
    img.alt = text;
    img.dataset.kind = 'placeholder';
  }

  // `stream`: a camera of a pipeline over several (its own frame), else
  // null (the pipeline's newest frame).
  function refreshSnapshot(name, stream, c, framesDone) {
    const now = Date.now();
    if (!c.img || now < c.snapRetryAt || now - c.snapAt < SNAPSHOT_EVERY_MS) return;
    if (framesDone === c.snapFrames) return;
    c.snapAt = now;
    c.snapFrames = framesDone;
    const probe = new Image();
    probe.onload = () => {
      c.img.src = probe.src;
      c.img.alt = 'latest frame of ' + name + (stream ? ', camera ' + stream : '');
      c.img.dataset.kind = 'snapshot';
    };
    probe.onerror = () => {
      // Not there (yet): keep the placeholder and ask again later.
      c.snapRetryAt = Date.now() + SNAPSHOT_RETRY_MS;
      if (c.img.dataset.kind !== 'snapshot') placeholder(c.img, 'no snapshot yet');
    };
    probe.src = '/v1/pipelines/' + encodeURIComponent(name) + '/snapshot.jpg?' +
      (stream ? 'stream=' + encodeURIComponent(stream) + '&' : '') + 'frame=' + framesDone;
  }

  // ---- views -------------------------------------------------------------

  // A snapshot with its overlay (pipelines that track). `label` names it.
  function frameView(label, tracked) {
    const root = el('div', 'view');
    const img = el('img', 'snapshot');
    img.dataset.field = 'snapshot';
    img.width = 320;
    img.height = 180;
    placeholder(img, 'no snapshot yet');
    root.appendChild(img);
    let overlay = null;
    if (tracked) {
      // Zones, lines and the live tracks, in source-frame pixels: the
      // viewBox is the frame's size, so the browser does the scaling.
      overlay = document.createElementNS(SVGNS, 'svg');
      overlay.setAttribute('class', 'overlay');
      overlay.setAttribute('preserveAspectRatio', 'none');
      overlay.setAttribute('role', 'img');
      overlay.setAttribute('aria-label', 'zones, lines and tracks of ' + label);
      overlay.dataset.field = 'overlay';
      root.appendChild(overlay);
    }
    const v = { root, img, overlay, tracking: null, snapAt: 0, snapFrames: -1, snapRetryAt: 0 };
    if (overlay) img.addEventListener('load', () => { if (v.tracking) drawOverlay(v, v.tracking); });
    return v;
  }

  // What a camera's overlay draws: the zones and lines of that camera (and
  // those of every stream, which apply to it too), its frame size and its
  // newest frame's tracks.
  function cameraTracking(t, name) {
    const cam = (t.cameras || []).find(x => x && x.name === name) || {};
    const mine = x => x && (x.camera === undefined || x.camera === null || x.camera === name);
    const geo = t.geometry || {};
    return {
      geometry: { zones: (geo.zones || []).filter(mine), lines: (geo.lines || []).filter(mine) },
      frame_size: cam.frame_size || null,
      live: cam.live || null,
      occupancy: t.occupancy,
      stream: name,
    };
  }

  const CAMERA_ROWS = [
    ['fps', 'cam_fps'], ['frames in', 'cam_frames_in'], ['frame age p99', 'cam_frame_age_p99'],
    ['drops', 'cam_drops'], ['last error', 'cam_last_error'], ['open tracks', 'cam_tracks_open'],
  ];

  function cameraFigure(pipeline, name, tracked) {
    const fig = el('figure', 'camera');
    fig.dataset.camera = name;
    const v = frameView(pipeline + ', camera ' + name, tracked);
    fig.appendChild(v.root);
    const cap = el('figcaption');
    cap.appendChild(el('strong', 'camera-name', name));
    const dl = el('dl');
    for (const [label, f] of CAMERA_ROWS) {
      dl.appendChild(el('dt', null, label));
      const dd = el('dd', null, '–');
      dd.dataset.field = f;
      dl.appendChild(dd);
    }
    cap.appendChild(dl);
    fig.appendChild(cap);
    v.figure = fig;
    return v;
  }

  // The picture of an image pipeline: one view, or one per camera of a
  // pipeline over several (`p.cameras`), side by side.
  function build(p) {
    const tracked = !!p.tracking;
    const cams = Array.isArray(p.cameras) ? p.cameras : [];
    if (cams.length === 0) {
      const v = frameView(p.name, tracked);
      return { root: v.root, single: v, cameras: null };
    }
    const root = el('div', 'cameras');
    root.dataset.field = 'cameras';
    const cameras = new Map();
    for (const cam of cams) {
      const v = cameraFigure(p.name, String(cam.name), tracked);
      cameras.set(String(cam.name), v);
      root.appendChild(v.figure);
    }
    return { root, single: null, cameras };
  }

  function drops(d) {
    // `fps` is the camera's subsampling, not a loss.
    const lost = Object.entries(d || {}).filter(([r, n]) => r !== 'fps' && n > 0);
    return lost.length ? lost.map(([r, n]) => r + ' ' + n).join(', ') : 'none';
  }

  // A tick: each view's snapshot (when frames were done since), overlay
  // and figures.
  function update(view, p) {
    if (view.single) {
      refreshSnapshot(p.name, null, view.single, p.frames_done);
      if (p.tracking) {
        view.single.tracking = p.tracking;
        drawOverlay(view.single, p.tracking);
      }
      return;
    }
    for (const cam of p.cameras || []) {
      const v = view.cameras.get(String(cam.name));
      if (!v) continue;
      refreshSnapshot(p.name, String(cam.name), v, cam.frames_done);
      const f = v.figure;
      set(f, 'cam_fps', rate(cam.fps));
      set(f, 'cam_frames_in', num(cam.frames_in));
      set(f, 'cam_frame_age_p99', us((cam.frame_age || {}).p99_us));
      set(f, 'cam_drops', drops(cam.drops));
      set(f, 'cam_last_error', cam.last_error ? String(cam.last_error) : 'none');
      set(f, 'cam_tracks_open', num(cam.tracks_open));
      if (p.tracking) {
        v.tracking = cameraTracking(p.tracking, String(cam.name));
        drawOverlay(v, v.tracking);
      }
    }
  }

  // A camera list of the status: what the views were built for.
  function signature(p) {
    return (p.cameras || []).map(c => c.name).join(',');
  }

  return { build, update, signature, shortId };
})();
