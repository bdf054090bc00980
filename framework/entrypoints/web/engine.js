// The engine page: /metrics read each second, its counters turned into rates and latencies
// over a window, and its gauges shown as they are.
"use strict";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;
const KEEP_SECONDS = 900;
const LIVE_SECONDS = 5;
const samples = [];
let scrapes = 0;

// Prometheus text exposition -> [{name, labels, value}].
function parseMetrics(text) {
  const out = [];
  const line = /^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
  const label = /([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
  for (const row of text.split("\n")) {
    if (!row || row.startsWith("#")) continue;
    const m = line.exec(row);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(label)) labels[l[1]] = l[2];
    out.push({ name: m[1], labels, value: Number(m[3]) });
  }
  // Under --metrics-names vllm a series has only its vllm: name; read it as the tokenmill: one.
  const own = new Set(out.filter((m) => m.name.startsWith("tokenmill:")).map((m) => m.name));
  return out.flatMap((m) => {
    if (!m.name.startsWith("vllm:")) return [m];
    const name = "tokenmill:" + m.name.slice("vllm:".length);
    return own.has(name) ? [] : [{ ...m, name }];
  });
}

function sum(metrics, name) {
  let total = 0;
  for (const m of metrics) if (m.name === name) total += m.value;
  return total;
}

function histogram(metrics, name) {
  const buckets = new Map();
  for (const m of metrics) {
    if (m.name === `${name}_bucket`) {
      const le = m.labels.le === "+Inf" ? Infinity : Number(m.labels.le);
      buckets.set(le, (buckets.get(le) || 0) + m.value);
    }
  }
  return {
    sum: sum(metrics, `${name}_sum`),
    count: sum(metrics, `${name}_count`),
    buckets: [...buckets.entries()].sort((a, b) => a[0] - b[0]),
  };
}

// One scrape, summed over engines (data-parallel ranks).
function snapshot(metrics, t) {
  const finished = {};
  for (const m of metrics) {
    if (m.name === "tokenmill:request_success_total") {
      const reason = m.labels.finished_reason;
      finished[reason] = (finished[reason] || 0) + m.value;
    }
  }
  return {
    t,
    running: sum(metrics, "tokenmill:num_requests_running"),
    waiting: sum(metrics, "tokenmill:num_requests_waiting"),
    kvTotal: sum(metrics, "tokenmill:kv_blocks_total"),
    kvFree: sum(metrics, "tokenmill:kv_blocks_free"),
    promptTokens: sum(metrics, "tokenmill:prompt_tokens_total"),
    generationTokens: sum(metrics, "tokenmill:generation_tokens_total"),
    prefixQueries: sum(metrics, "tokenmill:prefix_cache_queries_total"),
    prefixHits: sum(metrics, "tokenmill:prefix_cache_hits_total"),
    preemptions: sum(metrics, "tokenmill:num_preemptions_total"),
    finished,
    ttft: histogram(metrics, "tokenmill:time_to_first_token_seconds"),
    tpot: histogram(metrics, "tokenmill:request_time_per_output_token_seconds"),
  };
}

function kvUse(s) {
  return s.kvTotal ? (s.kvTotal - s.kvFree) / s.kvTotal : 0;
}

function rate(a, b, key) {
  return b.t > a.t ? Math.max(0, b[key] - a[key]) / (b.t - a.t) : null;
}

function meanBetween(a, b, key) {
  const count = b[key].count - a[key].count;
  return count > 0 ? (b[key].sum - a[key].sum) / count : null;
}

// The q-quantile of the observations between two scrapes, interpolated in its bucket as
// Prometheus's histogram_quantile does.
function quantileBetween(a, b, key, q) {
  const before = new Map(a[key].buckets);
  const delta = b[key].buckets.map(([le, n]) => [le, n - (before.get(le) || 0)]);
  const total = delta.length ? delta[delta.length - 1][1] : 0;
  if (total <= 0) return null;
  const rank = q * total;
  let lower = 0;
  let below = 0;
  for (const [le, n] of delta) {
    if (n >= rank) {
      if (le === Infinity) return lower;
      return lower + ((le - lower) * (rank - below)) / Math.max(n - below, 1e-12);
    }
    lower = le;
    below = n;
  }
  return lower;
}

// The oldest sample at most `seconds` before the newest.
function since(seconds) {
  const newest = samples[samples.length - 1];
  return samples.find((s) => newest.t - s.t <= seconds) || newest;
}

function windowSeconds() {
  return Number($("window").value);
}

function show() {
  const now = samples[samples.length - 1];
  const win = since(windowSeconds());
  const live = since(LIVE_SECONDS);
  $("m-running").textContent = formatNumber(now.running, 0);
  $("m-waiting").textContent = formatNumber(now.waiting, 0);
  $("m-kv").textContent = `${formatNumber(kvUse(now) * 100)}%`;
  $("m-kv-blocks").textContent =
    `${formatNumber(now.kvTotal - now.kvFree, 0)} of ${formatNumber(now.kvTotal, 0)} blocks in use`;
  const queries = now.prefixQueries - win.prefixQueries;
  $("m-prefix").textContent =
    queries > 0 ? `${formatNumber(((now.prefixHits - win.prefixHits) / queries) * 100)}%` : "–";
  $("m-prefix-total").textContent = now.prefixQueries
    ? `${formatNumber((now.prefixHits / now.prefixQueries) * 100)}% since start`
    : "no prompt looked up yet";
  $("m-gen-tps").textContent = formatNumber(rate(live, now, "generationTokens"));
  $("m-gen-total").textContent = `tokens/s · ${formatNumber(now.generationTokens, 0)} generated`;
  $("m-prompt-tps").textContent = formatNumber(rate(live, now, "promptTokens"));
  $("m-prompt-total").textContent = `tokens/s · ${formatNumber(now.promptTokens, 0)} prefilled`;
  for (const key of ["ttft", "tpot"]) {
    $(`m-${key}`).textContent = formatSeconds(meanBetween(win, now, key));
    const p50 = quantileBetween(win, now, key, 0.5);
    const p90 = quantileBetween(win, now, key, 0.9);
    $(`m-${key}-q`).textContent =
      p50 === null ? "mean in the window" : `mean · p50 ${formatSeconds(p50)} · p90 ${formatSeconds(p90)}`;
  }
  const reasons = Object.entries(now.finished).filter(([, n]) => n > 0);
  $("m-finished").textContent = formatNumber(
    reasons.reduce((total, [, n]) => total + n, 0),
    0,
  );
  $("m-finished-reasons").textContent = reasons.length
    ? reasons.map(([reason, n]) => `${reason} ${formatNumber(n, 0)}`).join(" · ")
    : "requests";
  $("m-preempt").textContent = formatNumber(now.preemptions, 0);
  drawCharts();
}

const COLORS = ["#3b6fd8", "#e07b39", "#3aa66a", "#b84fc4"];

const CHARTS = {
  requests: [
    ["running", (a, b) => b.running],
    ["waiting", (a, b) => b.waiting],
  ],
  kv: [["used", (a, b) => kvUse(b) * 100]],
  tokens: [
    ["generation", (a, b) => rate(a, b, "generationTokens")],
    ["prompt", (a, b) => rate(a, b, "promptTokens")],
  ],
  latency: [
    ["TTFT mean", (a, b) => scale(meanBetween(a, b, "ttft"), 1000)],
    ["TPOT mean", (a, b) => scale(meanBetween(a, b, "tpot"), 1000)],
  ],
};

function scale(value, factor) {
  return value === null ? null : value * factor;
}

function drawCharts() {
  const newest = samples[samples.length - 1];
  const start = newest.t - windowSeconds();
  for (const [chart, series] of Object.entries(CHARTS)) {
    const points = series.map(([, value]) => {
      const out = [];
      for (let i = 1; i < samples.length; i++) {
        if (samples[i].t < start) continue;
        out.push([samples[i].t, value(samples[i - 1], samples[i])]);
      }
      return out;
    });
    draw($(`c-${chart}`), points, start, newest.t, chart === "kv" ? 100 : null);
  }
}

function niceMax(value) {
  if (value <= 0) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= value) return step * power;
  return 10 * power;
}

function draw(canvas, series, start, end, fixedMax) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  const style = getComputedStyle(document.body);
  const ink = style.getPropertyValue("--muted").trim() || "#888";
  const left = 44;
  const bottom = height - 18;
  const plotWidth = width - left - 8;
  const plotHeight = bottom - 8;
  let max = fixedMax;
  if (max === null) {
    const values = series.flat().map(([, v]) => v).filter((v) => v !== null);
    max = niceMax(Math.max(0, ...values));
  }
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = ink;
  ctx.strokeStyle = ink;
  ctx.globalAlpha = 0.25;
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = bottom - (plotHeight * i) / 4;
    ctx.beginPath();
    ctx.moveTo(left, y);
    ctx.lineTo(left + plotWidth, y);
    ctx.stroke();
  }
  ctx.globalAlpha = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  const digits = Number.isInteger(max / 4) ? 0 : 2;
  for (let i = 0; i <= 4; i++) {
    ctx.fillText(formatNumber((max * i) / 4, digits), left - 6, bottom - (plotHeight * i) / 4);
  }
  ctx.textAlign = "left";
  ctx.textBaseline = "alphabetic";
  ctx.fillText(`−${formatNumber((end - start) / 60, 0)} min`, left, height - 4);
  ctx.textAlign = "right";
  ctx.fillText("now", left + plotWidth, height - 4);
  const x = (t) => left + ((t - start) / (end - start || 1)) * plotWidth;
  const y = (v) => bottom - (Math.min(v, max) / max) * plotHeight;
  series.forEach((points, index) => {
    ctx.strokeStyle = ctx.fillStyle = COLORS[index % COLORS.length];
    ctx.lineWidth = 2;
    ctx.beginPath();
    let drawing = false;
    for (const [t, v] of points) {
      if (v === null) {
        drawing = false;
        continue;
      }
      if (drawing) ctx.lineTo(x(t), y(v));
      else ctx.moveTo(x(t), y(v));
      drawing = true;
      ctx.fillRect(x(t) - 1.5, y(v) - 1.5, 3, 3);
    }
    ctx.stroke();
  });
}

function addLegends() {
  for (const span of document.querySelectorAll(".legend")) {
    const names = CHARTS[span.dataset.chart].map(([name]) => name);
    span.replaceChildren(
      ...names.map((name, index) => {
        const item = document.createElement("span");
        item.className = `key key-${index}`;
        item.textContent = name;
        return item;
      }),
    );
  }
}

async function poll() {
  try {
    const response = await api("/metrics");
    if (!response.ok) throw new Error(await errorMessage(response));
    const t = performance.now() / 1000;
    const metrics = parseMetrics(await response.text());
    samples.push(snapshot(metrics, t));
    while (samples.length > 2 && t - samples[0].t > KEEP_SECONDS + 1) samples.shift();
    show();
    const models = [...new Set(metrics.map((m) => m.labels.model_name).filter(Boolean))];
    $("engine-status").textContent =
      `${models.join(", ")} · updated ${new Date().toLocaleTimeString()}`;
    $("engine-status").classList.remove("error");
    document.body.dataset.scrapes = String(++scrapes);
  } catch (e) {
    $("engine-status").textContent = `Cannot read /metrics: ${e.message}`;
    $("engine-status").classList.add("error");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

$("window").addEventListener("change", () => samples.length && show());
window.addEventListener("resize", () => samples.length && drawCharts());
addLegends();
poll();
