// The dashboard's page: renders each snapshot /api/stream sends (server-sent events,
// one per change of this node's feed, and every two seconds). Read-only: it only reads.
"use strict";

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function fill(id, rows, render) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren();
  for (const item of rows) render(body.insertRow(), item);
}

function seconds(ms) {
  return `${(ms / 1000).toFixed(1)} s`;
}

function line(id, values, top) {
  const n = values.length;
  const points = values.map((v, i) => {
    const x = n > 1 ? (i / (n - 1)) * 600 : 0;
    const y = 155 - (top > 0 ? (v / top) * 145 : 0);
    return `${x.toFixed(1)},${y.toFixed(1)}`;
  });
  document.getElementById(id).setAttribute("points", points.join(" "));
}

// Why this node decides no claims now: a member of a region of several names the
// member that does (or says none is known); any other node is catching up.
function notDeciding(s) {
  if (!s.member) return "catching up: not deciding claims";
  const of = s.members.length ? ` (members ${s.members.join(", ")})` : "";
  if (!s.decider) return `member ${s.member}: no decider known for its region${of}`;
  return `member ${s.member}: ${s.decider.member} decides (term ${s.decider.term})${of}`;
}

// A member that decides says so with its term; a node of a region of one just decides.
function deciding(s) {
  if (!s.member) return "deciding claims";
  return `member ${s.member}: deciding claims${s.decider ? ` (term ${s.decider.term})` : ""}`;
}

function render(s) {
  document.getElementById("region").textContent = `${s.region} · ${s.node_id}`;
  document.getElementById("summary").textContent =
    `${s.records} records · ${s.deciding ? deciding(s) : notDeciding(s)}`;
  fill("backlog", s.backlog, (row, t) => {
    row.dataset.topic = t.topic;
    cell(row, t.topic);
    for (const status of ["open", "claimed", "done", "parked"]) cell(row, t[status], `num ${status}`);
  });
  document.getElementById("partial").hidden = !s.partial;
  document.getElementById("claims-total").textContent = `(${s.claims_total})`;
  fill("claims", s.claims, (row, c) => {
    row.dataset.key = c.key;
    cell(row, c.key);
    cell(row, c.owner, "owner");
    cell(row, c.token || "hidden", "num token");
    cell(row, seconds(c.left_ms), "num left");
  });
  fill("peers", s.peers, (row, p) => {
    if (!p.reachable || p.skew_alarms > 0) row.className = "bad";
    cell(row, p.name);
    cell(row, p.reachable ? "yes" : `no${p.last_error ? ": " + p.last_error : ""}`);
    cell(row, seconds(p.lag_ms), "num");
    cell(row, p.divergence, "num");
    cell(row, p.skew_alarms, "num");
  });
  fill("refusals", s.refusals, (row, r) => {
    cell(row, new Date(r.at_ms).toLocaleTimeString());
    cell(row, r.method);
    cell(row, r.reason, "reason");
    cell(row, r.request_id);
  });
  const changes = s.series.map((p) => p.changes);
  const lags = s.series.map((p) => p.lag_ms);
  const changesPeak = Math.max(1, ...changes);
  const lagPeak = Math.max(1, ...lags);
  line("changes-line", changes, changesPeak);
  line("lag-line", lags, lagPeak);
  document.getElementById("changes-peak").textContent = `${changesPeak}`;
  document.getElementById("lag-peak").textContent = seconds(lagPeak);
  const last = s.series[s.series.length - 1];
  document.getElementById("changes-now").textContent = last ? `${last.changes}` : "";
  document.getElementById("lag-now").textContent = last ? seconds(last.lag_ms) : "";
  document.body.dataset.feed = s.feed;
}

function connect() {
  const state = document.getElementById("connection");
  const stream = new EventSource("api/stream");
  stream.onopen = () => { state.textContent = "live"; state.className = "state live"; };
  stream.onmessage = (event) => render(JSON.parse(event.data));
  stream.onerror = () => { state.textContent = "reconnecting"; state.className = "state lost"; };
}

connect();
