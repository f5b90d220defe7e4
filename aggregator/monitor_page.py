"""The monitor's page and script, shipped in the wheel as text: no framework, no CDN.

The script fetches ``/api/fleet?page=N`` every two seconds and redraws the tables and three
charts (inline SVG drawn here): the global model's accuracy per round, the devices' accuracy
over time (held-out solid, prequential dashed, a legend of device colours beneath; the ten
lowest of a larger fleet) and the bytes sent and received; each role's last error above
them, and tables that scroll sideways rather than widen the page (the devices' fits 1,400
px: short headers that wrap, related counts in one cell, bytes with their units).  The
devices' table holds a page of rows, those in trouble first (offline, in error, not
predicting now), with buttons to the others: a thousand devices' rows and series were 15 MB
every two seconds.  Every value goes
into the page as text (``textContent``), never as markup, since device ids and states come
from the fleet.  Each chart's lines carry their values in ``data-values`` so a test (or a
curious user) can read the series off the rendered page.
"""

from __future__ import annotations

from typing import Any

from edge_client.inference import FallingBehind

from .status import STALE_PREDICTION_S

__all__ = ["PAGE", "SCRIPT", "PAGE_ROWS", "CHART_DEVICES", "SHOWN_ERRORS", "trouble",
           "requested_page"]

# A thousand devices' rows and series were 15 MB of JSON every two seconds: the page holds a
# page of rows (the devices in trouble first), the lowest accuracies' series, and counts.
PAGE_ROWS = 100
CHART_DEVICES = 10
SHOWN_ERRORS = 20


def trouble(row: dict[str, Any]) -> tuple[int, str]:
    """Device rows in the order an operator reads them: offline, in error or not predicting
    now (its camera lost, or its last prediction older than ``STALE_PREDICTION_S``), then
    drifting (its station found its accuracy fell), refused or clipped, then the rest; by
    id within each."""
    quiet = row.get("camera_outage") or (row.get("prediction_age") or 0) > STALE_PREDICTION_S
    if row["presence"] is False or row.get("error") or quiet:
        return 0, row["id"]
    flagged = row.get("drift_from") is not None or row.get("refused") or row.get("clipped")
    return (1 if flagged else 2), row["id"]


def requested_page(path: str) -> int | None:
    """The ``page`` a request asks for (0 without one; None where it is not a number)."""
    query = dict(p.split("=", 1) for p in path.partition("?")[2].split("&") if "=" in p)
    value = query.get("page", "0")
    return int(value) if value.isdigit() and len(value) < 7 else None

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>safl-edge monitor</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.2em; color: #1b1f24; background: #fff; }
h1 { font-size: 1.3em; margin: 0 0 .3em; } h2 { font-size: 1.05em; margin: 1.2em 0 .4em; }
#summary span { margin-right: 1.4em; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { padding: 2px 5px; border-bottom: 1px solid #d8dee4; text-align: right; }
th { background: #f3f5f7; white-space: normal; max-width: 5.5em; vertical-align: bottom;
     font-weight: 600; font-size: 12px; }
td:first-child, th:first-child { text-align: left; } td { white-space: nowrap; }
td.stale { color: #b3261e; font-weight: 600; }
.on { color: #116329; font-weight: 600; } .off { color: #b3261e; font-weight: 600; }
.charts { display: flex; flex-wrap: wrap; gap: 1.2em; }
figure { margin: 0; } figcaption { font-weight: 600; margin-bottom: .2em; }
svg text { font-size: 11px; fill: #57606a; } .muted { color: #57606a; }
.scroll { max-width: 100%; overflow-x: auto; } .legend { max-width: 420px; font-size: 12px; }
.legend span { margin-right: .9em; white-space: nowrap; }
#errors div { color: #b3261e; font-weight: 600; margin: .2em 0; }
</style></head>
<body>
<h1>safl-edge fleet <span id="fleet">?</span></h1>
<div id="summary" class="muted">waiting for the fleet's retained state...</div>
<div id="errors"></div>
<div class="charts">
<figure><figcaption>Global model accuracy, by round</figcaption>
<svg id="global-accuracy" width="420" height="240"></svg></figure>
<figure><figcaption>Device accuracy over time (solid: held-out, dashed: prequential)</figcaption>
<svg id="device-accuracy" width="420" height="240"></svg>
<div id="device-legend" class="legend"></div></figure>
<figure><figcaption>Bytes sent and received by devices and stations (MB)</figcaption>
<svg id="traffic" width="420" height="240"></svg></figure>
</div>
<h2>Stations</h2><div class="scroll"><table id="stations"></table></div>
<h2>Devices</h2>
<div id="pager" class="muted"><button id="prev">&lt; previous</button>
<span id="page-of"></span> <button id="next">next &gt;</button></div>
<div class="scroll"><table id="devices"></table></div>
<p class="muted" id="footer"></p>
<script src="/monitor.js"></script>
</body></html>
"""

SCRIPT = r"""'use strict';
const STALE_PREDICTION_S = @STALE@;  // aggregator/status.py
const BEHIND = @BEHIND@;  // edge_client/inference.py: FallingBehind
const COLORS = ['#0969da', '#cf222e', '#1a7f37', '#8250df', '#bc4c00', '#1b7c83', '#d4a72c',
                '#57606a', '#e85aad', '#4d2d00'];
const SVGNS = 'http://www.w3.org/2000/svg';

function fmt(v, digits) {
  if (v === null || v === undefined) return '-';
  if (digits === 'bytes') return bytes(v);
  if (digits === 'share' && typeof v === 'number') return Math.round(v * 100) + '%';
  if (typeof v === 'number') return digits === undefined ? String(v) : v.toFixed(digits);
  return String(v);
}

function bytes(v) {
  if (typeof v !== 'number') return fmt(v);
  const units = ['B', 'kB', 'MB', 'GB', 'TB'];
  let i = 0;
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
  return (i ? v.toFixed(v < 10 ? 2 : v < 100 ? 1 : 0) : String(v)) + ' ' + units[i];
}

function el(tag, attrs, text, ns) {
  const e = ns ? document.createElementNS(SVGNS, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function draw(svg, tag, attrs, text) {
  svg.appendChild(el(tag, attrs, text, true));
}

function presence(online) {
  const span = el('span', {class: online ? 'on' : online === false ? 'off' : ''},
                  online ? 'online' : online === false ? 'offline' : '?');
  return span;
}

function table(id, columns, rows) {
  const t = document.getElementById(id);
  t.replaceChildren();
  const head = el('tr');
  for (const [, label] of columns) head.appendChild(el('th', {}, label));
  t.appendChild(head);
  for (const row of rows) {
    const tr = el('tr', {id: id + '-' + row.id});
    for (const [key, , digits] of columns) {
      const td = el('td');
      if (key === 'presence') td.appendChild(presence(row.presence));
      else if (Array.isArray(key)) td.textContent = key.map(
        (k, i) => fmt(row[k], Array.isArray(digits) ? digits[i] : undefined)).join(' / ');
      else if (key === 'prequential_accuracy' && row.drift_from != null) td.textContent =
        fmt(row[key], digits) + ' \u2193 ' + fmt(row.drift_from, 2);
      else if (key === 'lags') td.textContent = fmt(row.label_lag, 2) + ' (' +
        fmt(row.label_lag_estimate, 2) + ')';
      else td.textContent = fmt(row[key], digits);
      if ((key === 'prediction_age' && row[key] > STALE_PREDICTION_S) ||
          (key === 'camera_outage' && row[key] > 0) ||
          (key === 'prequential_accuracy' && row.drift_from != null) ||
          (Array.isArray(key) && key[0] === 'predictions_behind' &&
           row.predictions_behind > BEHIND)) td.className = 'stale';
      tr.appendChild(td);
    }
    t.appendChild(tr);
  }
}

function niceTicks(lo, hi, count, integer) {
  if (hi <= lo) hi = lo + 1;
  let step = (hi - lo) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(step)));
  step = [1, 2, 5, 10].map(f => f * mag).find(s => s >= step);
  if (integer) step = Math.max(1, Math.round(step));
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) ticks.push(v);
  return ticks;
}

// series: [{name, points: [[x, y], ...], color, dash}]
function chart(id, series, opts) {
  const svg = document.getElementById(id);
  svg.replaceChildren();
  const W = +svg.getAttribute('width'), H = +svg.getAttribute('height');
  const L = 46, R = 10, T = 10, B = 34;
  const xs = series.flatMap(s => s.points.map(p => p[0]));
  const ys = series.flatMap(s => s.points.map(p => p[1])).filter(y => y !== null);
  if (!xs.length) {
    draw(svg, 'text', {x: L, y: H / 2}, 'no data yet');
    return;
  }
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  const y0 = opts.yMin !== undefined ? opts.yMin : Math.min(...ys, 0);
  const y1 = opts.yMax !== undefined ? opts.yMax : Math.max(...ys, y0 + 1e-9) * 1.05;
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const Y = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  draw(svg, 'line', {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: '#8c959f'});
  draw(svg, 'line', {x1: L, y1: T, x2: L, y2: H - B, stroke: '#8c959f'});
  for (const v of niceTicks(x0, x1, 6, opts.xInteger)) {
    draw(svg, 'text', {x: X(v), y: H - B + 14, 'text-anchor': 'middle'},
         opts.xInteger ? String(Math.round(v)) : String(+v.toFixed(1)));
  }
  for (const v of niceTicks(y0, y1, 4, false)) {
    draw(svg, 'line', {x1: L, y1: Y(v), x2: W - R, y2: Y(v), stroke: '#eaeef2'});
    draw(svg, 'text', {x: L - 4, y: Y(v) + 4, 'text-anchor': 'end'}, String(+v.toFixed(3)));
  }
  draw(svg, 'text', {x: (L + W - R) / 2, y: H - 4, 'text-anchor': 'middle'}, opts.xLabel);
  if (opts.legend) {
    series.forEach((s, i) => draw(svg, 'text', {x: L + 8, y: T + 12 + 13 * i, fill: s.color,
                                              style: 'fill: ' + s.color}, s.name));
  }
  for (const s of series) {
    const pts = s.points.filter(p => p[1] !== null);
    if (!pts.length) continue;
    const line = el('polyline', {
      points: pts.map(p => X(p[0]).toFixed(1) + ',' + Y(p[1]).toFixed(1)).join(' '),
      fill: 'none', stroke: s.color, 'stroke-width': 2, 'data-name': s.name,
      'data-values': pts.map(p => p[1]).join(',')}, undefined, true);
    if (s.dash) line.setAttribute('stroke-dasharray', '5 3');
    line.appendChild(el('title', {}, s.name, true));
    svg.appendChild(line);
  }
}

let page = 0;  // of the devices' table, PAGE_ROWS rows each, those in trouble first

function render(doc) {
  document.getElementById('fleet').textContent = doc.fleet;
  const c = doc.cloud || {};
  const online = doc.devices_online;
  page = doc.page;
  const first = doc.page * doc.page_rows;
  document.getElementById('page-of').textContent = 'devices ' +
    (doc.devices_total ? first + 1 : 0) + '-' + (first + doc.devices.length) + ' of ' +
    doc.devices_total + ' (offline, in error, drifting or refused first), page ' + (doc.page + 1) +
    ' of ' + doc.pages;
  document.getElementById('prev').disabled = doc.page === 0;
  document.getElementById('next').disabled = doc.page + 1 >= doc.pages;
  const summary = document.getElementById('summary');
  summary.replaceChildren(
    el('span', {}, 'cloud: '), presence(c.presence),
    el('span', {}, ' state ' + fmt(c.state) + ', round ' + fmt(c.round) +
       ', accuracy ' + fmt(c.accuracy, 4)),
    el('span', {id: 'devices-online'}, 'devices online: ' + online + ' of ' + doc.devices_total),
    ...(c.products && c.products.length ? [el('span', {id: 'products'}, ' products: ' +
      c.products.map(p => (c.retired || []).includes(p) ? p + ' (retired)' : p).join(', ') +
      ' (' + (c.classes - c.products.length) + ' of ' + c.classes + ' classes free)')] : []));
  table('stations', [['id', 'station'], ['presence', 'presence'], ['state', 'state'],
    ['round', 'round'], ['iteration', 'iter'], ['online', 'online'], ['devices', 'roster'],
    ['uploads', 'uploads'], ['skips', 'skips'], ['refused', 'refused'], ['clipped', 'clipped'],
    ['devices_drifting', 'drifting'],
    ['local_mean', 'held-out', 3], ['prequential_mean', 'prequential', 3],
    ['bytes_in', 'received', 'bytes'], ['bytes_out', 'sent', 'bytes']], doc.stations);
  table('devices', [['id', 'device'], ['station', 'station'], ['presence', 'presence'],
    ['state', 'state'], [['round', 'iteration'], 'round / iter'],
    ['prediction_age', 'last prediction, s ago', 1], ['camera_outage', 'camera lost, s', 0],
    [['predictions_behind', 'unknown'], 'unpredicted / unknown', ['share']],
    ['local_accuracy', 'held-out', 3],
    ['prequential_accuracy', 'test then train (\u2193 fell from)', 3],
    ['deployed_round', 'round in use'], ['shadow_accuracy', 'candidate', 3],
    ['promotions_refused', 'models refused'], [['uploads', 'skips'], 'uploads / skips'],
    [['refused', 'clipped'], 'claims refused / clipped'], ['frames_dropped', 'frames dropped'],
    [['label_joined', 'label_unmatched', 'label_expired', 'labels_held'],
     'labels joined / unmatched / expired / held'],
    ['lags', 'label lag s (measured)'], ['body_ms_per_frame', 'body ms a frame', 1],
    ['bytes_out', 'sent', 'bytes'], ['bytes_in', 'received', 'bytes']],
    doc.devices);
  chart('global-accuracy', [{name: 'global', color: COLORS[0], points: doc.global_accuracy}],
        {xInteger: true, xLabel: 'round', yMin: 0, yMax: 1});
  // Each role's last unexpected error, where it has one: a stalled fleet says why here.
  const errors = [['cloud', c.error], ...doc.stations.map(s => [s.id, s.error]),
                  ...doc.device_errors].filter(e => e[1]);
  const more = doc.device_errors_total - doc.device_errors.length;
  document.getElementById('errors').replaceChildren(
    ...errors.map(([who, e]) => el('div', {}, 'ERROR ' + who + ': ' + e)),
    ...(more > 0 ? [el('div', {}, 'and ' + more + ' devices more in error')] : []));
  const devs = Object.entries(doc.device_accuracy);
  const lowest = devs.length < doc.devices_total ?
    [el('span', {}, 'the ' + devs.length + ' of ' + doc.devices_total + ' lowest now:')] : [];
  document.getElementById('device-legend').replaceChildren(...lowest, ...devs.map(([d], i) =>
    el('span', {style: 'color: ' + COLORS[i % COLORS.length]}, '\u25a0 ' + d)));
  chart('device-accuracy', devs.flatMap(([d, pts], i) => [
    {name: d + ' held-out', color: COLORS[i % COLORS.length], points: pts.map(p => [p[0], p[1]])},
    {name: d + ' prequential', color: COLORS[i % COLORS.length], dash: true,
     points: pts.map(p => [p[0], p[2]])}]), {xLabel: 'seconds', yMin: 0, yMax: 1});
  chart('traffic', [
    {name: 'sent', color: COLORS[0], points: doc.traffic.map(p => [p[0], p[1] / 1e6])},
    {name: 'received', color: COLORS[1], points: doc.traffic.map(p => [p[0], p[2] / 1e6])}],
    {xLabel: 'seconds', legend: true});
  document.getElementById('footer').textContent = 'monitor up ' + doc.seconds +
    ' s; updated ' + new Date().toLocaleTimeString();
  document.body.setAttribute('data-rendered', String(doc.seconds));
  // How wide the devices' table drew, for a test (or an operator's bug report) to read.
  document.body.setAttribute('data-devices-width',
                             String(document.getElementById('devices').scrollWidth));
}

async function refresh() {
  try {
    const r = await fetch('/api/fleet?page=' + page, {cache: 'no-store'});
    if (r.ok) render(await r.json());
  } catch (e) {
    document.getElementById('footer').textContent = 'monitor unreachable: ' + e;
  }
  setTimeout(refresh, 2000);
}
document.getElementById('prev').onclick = () => { page = Math.max(0, page - 1); };
document.getElementById('next').onclick = () => { page += 1; };
refresh();
"""
SCRIPT = SCRIPT.replace("@STALE@", repr(STALE_PREDICTION_S)).replace(
    "@BEHIND@", repr(FallingBehind.BEHIND))
