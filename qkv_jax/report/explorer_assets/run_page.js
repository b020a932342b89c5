// The run explorer. Reads the JSON payload in #run-data (written by qkv_jax.training.explorer)
// and builds the head view, the checkpoint slider and strip, the diagnostics table, the loss
// curves and the config tree from it. Nothing is fetched.
"use strict";

const DATA = JSON.parse(document.getElementById("run-data").textContent);
// The namespace of the page's own inline <svg>: new SVG elements need no namespace URL in this file.
const SVG_NS = document.getElementById("links").namespaceURI;
const ROW_HEIGHT = 20; // px between token rows in the head view
const LINK_WIDTH = 140; // px of the line area between the query and key columns
const TOP_K = 8; // rows of the largest-weights table
const ACCENT = "33, 102, 172"; // attention colour (r, g, b), as in the CSS
const PALETTE = ["#2166ac", "#d6604d", "#1b7837", "#762a83", "#b8860b", "#35978f", "#8c510a", "#c51b7d"];
const ALL_HEADS = "all";

const state = {
  example: 0,
  layer: 0,
  head: 0, // a head index, or ALL_HEADS
  checkpoint: DATA.checkpoints.length - 1,
  pinned: null, // the clicked query index
  hovered: null, // the query index under the pointer; shown instead of the pinned one
  playing: null, // the interval id while "play" steps through the checkpoints
};

function byId(id) {
  return document.getElementById(id);
}

function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (className) node.className = className;
  return node;
}

function svgElement(tag, attributes) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  return node;
}

// A legend item: a short line in `colour`, then `label`.
function legendEntry(label, colour) {
  const entry = element("span", label);
  const swatch = element("i");
  swatch.style.background = colour;
  entry.prepend(swatch);
  return entry;
}

// Whitespace tokens (common in a character LM) drawn as visible symbols.
function visibleToken(text) {
  return text.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5") || "\u2205";
}

function formatNumber(value) {
  return value === null ? "" : String(Number(value.toPrecision(4)));
}

// ---- Attention weights --------------------------------------------------------------------

function sizes(example) {
  const tokens = DATA.examples[example];
  return { T: tokens.query_tokens.length, S: tokens.key_tokens.length };
}

const decoded = new Map(); // "checkpoint/example" -> Uint8Array [layer][head][T][S]

function attentionBytes(checkpoint, example) {
  const key = checkpoint + "/" + example;
  if (!decoded.has(key)) {
    const text = atob(DATA.checkpoints[checkpoint].attention[example]);
    const bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    decoded.set(key, bytes);
  }
  return decoded.get(key);
}

// (query, key) -> weight of one head, or the mean over heads for ALL_HEADS. A weight is the
// stored byte / levels: exactly the number qkv_jax.training.explorer.page_attention returns.
function headWeights(checkpoint, example, layer, head) {
  const { T, S } = sizes(example);
  const bytes = attentionBytes(checkpoint, example);
  const start = (h) => (layer * DATA.num_heads + h) * T * S;
  if (head !== ALL_HEADS) {
    const base = start(head);
    return (t, s) => bytes[base + t * S + s] / DATA.levels;
  }
  return (t, s) => {
    let total = 0;
    for (let h = 0; h < DATA.num_heads; h++) total += bytes[start(h) + t * S + s];
    return total / DATA.num_heads / DATA.levels;
  };
}

function currentWeights() {
  return headWeights(state.checkpoint, state.example, state.layer, state.head);
}

function currentQuery() {
  return state.hovered ?? state.pinned;
}

// ---- Head view ----------------------------------------------------------------------------

function tokenElement(text, index, top) {
  const node = element("div", visibleToken(text), "token");
  node.dataset.index = index;
  node.style.top = top + "px";
  return node;
}

// Query t sits at key position t + S - T (queries are the last T positions), level with its key.
function queryTop(t) {
  const { T, S } = sizes(state.example);
  return (t + S - T) * ROW_HEIGHT;
}

function renderTokens() {
  const example = DATA.examples[state.example];
  const height = example.key_tokens.length * ROW_HEIGHT + "px";
  const queries = byId("query-column");
  const keys = byId("key-column");
  queries.replaceChildren();
  keys.replaceChildren();
  queries.style.height = keys.style.height = height;
  byId("links").setAttribute("height", parseInt(height));
  byId("links").setAttribute("width", LINK_WIDTH);
  example.query_tokens.forEach((text, t) => {
    const node = tokenElement(text, t, queryTop(t));
    node.title = "query " + t;
    node.addEventListener("mouseenter", () => setHovered(t));
    node.addEventListener("mouseleave", () => setHovered(null));
    node.addEventListener("click", () => setPinned(t));
    queries.appendChild(node);
  });
  example.key_tokens.forEach((text, s) => {
    const node = tokenElement(text, s, s * ROW_HEIGHT);
    if (example.marks.includes(s)) node.classList.add("marked");
    keys.appendChild(node);
  });
  // Tokens are placed absolutely, so the columns do not grow with them: fit each to its widest.
  for (const column of [queries, keys]) {
    const widest = Math.max(0, ...Array.from(column.children, (node) => node.scrollWidth + 2));
    column.style.width = widest + "px";
  }
}

// Key shading and data-weight: the weight the current query puts on each key.
function renderKeys(query, weight) {
  for (const node of byId("key-column").children) {
    const s = Number(node.dataset.index);
    if (query === null) {
      delete node.dataset.weight;
      node.style.background = "";
      node.style.color = "";
      node.title = "key " + s;
      continue;
    }
    const w = weight(query, s);
    node.dataset.weight = String(w);
    node.style.background = `rgba(${ACCENT}, ${w})`;
    node.style.color = w > 0.55 ? "#fff" : "";
    node.title = `key ${s}: weight ${w.toFixed(3)}`;
  }
}

// One line per (head, key) with a non-zero weight; opacity and thickness follow the weight.
function renderLinks(query) {
  const svg = byId("links");
  svg.replaceChildren();
  const heads = state.head === ALL_HEADS ? [...Array(DATA.num_heads).keys()] : [state.head];
  renderHeadLegend(heads);
  if (query === null) return;
  const { S } = sizes(state.example);
  for (const head of heads) {
    const weight = headWeights(state.checkpoint, state.example, state.layer, head);
    for (let s = 0; s < S; s++) {
      const w = weight(query, s);
      if (w === 0) continue;
      const line = svgElement("line", {
        x1: 2, y1: queryTop(query) + ROW_HEIGHT / 2 - 1, x2: LINK_WIDTH - 2, y2: s * ROW_HEIGHT + ROW_HEIGHT / 2 - 1,
        "stroke-opacity": w, "stroke-width": 1 + 5 * w, "data-head": head, "data-key": s, "data-weight": w,
      });
      if (heads.length > 1) line.style.stroke = PALETTE[head % PALETTE.length];
      svg.appendChild(line);
    }
  }
}

// With every head shown, which line colour is which head.
function renderHeadLegend(heads) {
  const legend = byId("head-legend");
  legend.replaceChildren();
  if (heads.length < 2) return;
  for (const head of heads) legend.appendChild(legendEntry("head " + head, PALETTE[head % PALETTE.length]));
}

function renderTopWeights(query, weight) {
  const body = byId("top-weights").tBodies[0];
  body.replaceChildren();
  const example = DATA.examples[state.example];
  const headName = state.head === ALL_HEADS ? "mean over heads" : "head " + state.head;
  if (query === null) {
    byId("top-weights-title").textContent = "Largest weights: hover or click a query token";
    return;
  }
  byId("top-weights-title").textContent =
    `Largest weights of query ${query} "${visibleToken(example.query_tokens[query])}" (${headName})`;
  const keys = example.key_tokens.map((_, s) => s);
  keys.sort((a, b) => weight(query, b) - weight(query, a));
  for (const s of keys.slice(0, TOP_K)) {
    const row = element("tr");
    row.dataset.key = s;
    row.dataset.weight = String(weight(query, s));
    row.append(element("td", String(s)), element("td", visibleToken(example.key_tokens[s])));
    row.append(element("td", weight(query, s).toFixed(3)));
    if (example.marks.includes(s)) row.className = "marked";
    body.appendChild(row);
  }
}

// Paints weight(t, s) as a T x S grid of `cell`-pixel squares on `canvas`.
function drawMatrix(canvas, weight, T, S, cell) {
  canvas.width = S * cell;
  canvas.height = T * cell;
  const context = canvas.getContext("2d");
  context.fillStyle = "#fff";
  context.fillRect(0, 0, canvas.width, canvas.height);
  for (let t = 0; t < T; t++) {
    for (let s = 0; s < S; s++) {
      const w = weight(t, s);
      if (w === 0) continue;
      context.fillStyle = `rgba(${ACCENT}, ${w})`;
      context.fillRect(s * cell, t * cell, cell, cell);
    }
  }
  return context;
}

function heatmapCell() {
  const { T, S } = sizes(state.example);
  return Math.max(2, Math.min(14, Math.floor(320 / Math.max(T, S))));
}

// The whole T x S map of the current head, with the marked keys and the current query outlined.
function renderHeatmap(query, weight) {
  const { T, S } = sizes(state.example);
  const cell = heatmapCell();
  const context = drawMatrix(byId("heatmap"), weight, T, S, cell);
  context.lineWidth = 1;
  context.strokeStyle = "rgba(192, 57, 43, 0.8)";
  for (const s of DATA.examples[state.example].marks) context.strokeRect(s * cell + 0.5, 0.5, cell - 1, T * cell - 1);
  if (query !== null) {
    context.strokeStyle = "#f39c12";
    context.lineWidth = 2;
    context.strokeRect(1, query * cell + 1, S * cell - 2, cell - 2);
  }
  const headName = state.head === ALL_HEADS ? "mean over heads" : "head " + state.head;
  byId("heatmap-title").textContent = `All queries (rows) and keys (columns), ${headName}`;
}

function heatmapPosition(event) {
  const canvas = byId("heatmap");
  const box = canvas.getBoundingClientRect();
  const { T, S } = sizes(state.example);
  const s = Math.floor(((event.clientX - box.left - canvas.clientLeft) / canvas.clientWidth) * S);
  const t = Math.floor(((event.clientY - box.top - canvas.clientTop) / canvas.clientHeight) * T);
  return t >= 0 && t < T && s >= 0 && s < S ? { t, s } : null;
}

function showHeatmapValue(event) {
  const position = heatmapPosition(event);
  const example = DATA.examples[state.example];
  byId("heatmap-readout").textContent =
    position === null
      ? "\u00a0"
      : `query ${position.t} "${visibleToken(example.query_tokens[position.t])}" \u2192 key ${position.s} ` +
        `"${visibleToken(example.key_tokens[position.s])}": ${currentWeights()(position.t, position.s).toFixed(3)}`;
}

function renderWeights() {
  const query = currentQuery();
  const weight = currentWeights();
  for (const node of byId("query-column").children) {
    node.classList.toggle("selected", Number(node.dataset.index) === query);
  }
  renderKeys(query, weight);
  renderLinks(query);
  renderTopWeights(query, weight);
  renderHeatmap(query, weight);
}

function setHovered(query) {
  state.hovered = query;
  renderWeights();
}

function setPinned(query) {
  state.pinned = query;
  renderWeights();
}

// ---- Checkpoints: slider, play button, strip ---------------------------------------------

function setCheckpoint(index) {
  state.checkpoint = index;
  const slider = byId("checkpoint-slider");
  slider.value = index;
  const label = byId("checkpoint-label");
  label.dataset.step = DATA.checkpoints[index].step;
  label.textContent = `step ${DATA.checkpoints[index].step} (${index + 1} of ${DATA.checkpoints.length})`;
  for (const item of byId("checkpoint-strip").children) {
    item.classList.toggle("current", Number(item.dataset.checkpoint) === index);
  }
  renderWeights();
  renderCircuits();
}

function togglePlay() {
  const button = byId("play-button");
  if (state.playing !== null) {
    clearInterval(state.playing);
    state.playing = null;
    button.textContent = "play";
    return;
  }
  if (state.checkpoint === DATA.checkpoints.length - 1) setCheckpoint(0);
  button.textContent = "pause";
  state.playing = setInterval(() => {
    if (state.checkpoint + 1 < DATA.checkpoints.length) setCheckpoint(state.checkpoint + 1);
    else togglePlay();
  }, 800);
}

// The current head (or the mean over heads) at every checkpoint, as small maps.
function renderStrip() {
  const strip = byId("checkpoint-strip");
  strip.replaceChildren();
  const { T, S } = sizes(state.example);
  const cell = Math.max(1, Math.floor(96 / Math.max(T, S)));
  DATA.checkpoints.forEach((checkpoint, index) => {
    const item = element("div", undefined, "strip-item");
    item.dataset.checkpoint = index;
    const canvas = element("canvas");
    drawMatrix(canvas, headWeights(index, state.example, state.layer, state.head), T, S, cell);
    item.append(canvas, element("div", "step " + checkpoint.step));
    item.classList.toggle("current", index === state.checkpoint);
    item.addEventListener("click", () => setCheckpoint(index));
    strip.appendChild(item);
  });
}

// ---- Circuits: spectra, composition, patching ----------------------------------------------

const CIRCUITS = DATA.circuits; // null on a page without the circuits view
const MATRIX_COLOURS = { qk: PALETTE[0], ov: PALETTE[1] };
const NEGATIVE = "192, 57, 43"; // a share below zero in the patching heat map (r, g, b)

function headLabel(layer, head) {
  return `${DATA.layers[layer]} head ${head}`;
}

// A table cell showing `value` (4 significant digits) that carries the exact number in data-value.
function numberCell(value) {
  const cell = element("td", formatNumber(value));
  cell.dataset.value = value === null ? "" : String(value);
  return cell;
}

// The spectra shown: [{matrix, head, checkpoint, values}] for the selected head (or every head).
function shownSpectra() {
  const heads = state.head === ALL_HEADS ? [...Array(DATA.num_heads).keys()] : [state.head];
  const spectra = [];
  for (const matrix of ["qk", "ov"]) {
    if (CIRCUITS[matrix] === null) continue;
    for (const head of heads) {
      const values = CIRCUITS[matrix].values[state.checkpoint][state.layer][head];
      const rank = CIRCUITS[matrix].effective_rank[state.checkpoint][state.layer][head];
      spectra.push({ matrix, head, values, rank });
    }
  }
  return spectra;
}

function spectrumColour(spectrum) {
  return state.head === ALL_HEADS ? PALETTE[spectrum.head % PALETTE.length] : MATRIX_COLOURS[spectrum.matrix];
}

// Singular value i (from 1) against i, log y: one polyline with a dot per value. With one head
// selected, the untrained parameters' spectra are drawn dashed beside the current checkpoint's.
function renderSpectrumPlot(spectra) {
  const svg = byId("spectrum-plot");
  svg.replaceChildren();
  const legend = byId("spectrum-legend");
  legend.replaceChildren();
  const untrained = state.head !== ALL_HEADS && state.checkpoint !== 0
    ? spectra.map((s) => ({ ...s, values: CIRCUITS[s.matrix].values[0][state.layer][s.head], untrained: true }))
    : [];
  const all = spectra.concat(untrained);
  const positive = all.flatMap((s) => s.values).filter((v) => v > 0);
  if (positive.length === 0) {
    svg.appendChild(svgElement("text", { x: 20, y: 30 })).textContent = "every singular value is zero";
    return;
  }
  const box = { left: 64, right: 464, top: 12, bottom: 220 };
  const [x0, x1] = extent(all.map((s) => s.values.length).concat([1]));
  const [y0, y1] = extent(positive.map(Math.log10));
  const sx = (i) => box.left + ((i - x0) / (x1 - x0)) * (box.right - box.left);
  const sy = (y) => box.bottom - ((y - y0) / (y1 - y0)) * (box.bottom - box.top);
  const xTicks = niceTicks(x0, x1, Math.min(8, x1 - x0)).filter(Number.isInteger);
  drawAxes(svg, box, xTicks.map((i) => [i, sx(i)]), logTicks(y0, y1).map((y) => [y, sy(y)]),
    (y) => formatNumber(Math.pow(10, y)), "index (largest first)");
  for (const spectrum of all) {
    const kept = spectrum.values.map((v, i) => [i + 1, v]).filter(([, v]) => v > 0);
    const colour = spectrumColour(spectrum);
    const dashed = spectrum.untrained || (state.head === ALL_HEADS && spectrum.matrix === "ov");
    const line = svgElement("polyline", {
      points: kept.map(([i, v]) => `${sx(i).toFixed(1)},${sy(Math.log10(v)).toFixed(1)}`).join(" "),
      fill: "none", stroke: colour, "stroke-width": spectrum.untrained ? 1 : 1.5,
      "stroke-dasharray": dashed ? "4 3" : "none", "data-matrix": spectrum.matrix, "data-head": spectrum.head,
    });
    svg.appendChild(line);
    if (spectrum.untrained) continue;
    for (const [i, v] of kept) {
      const dot = svgElement("circle", { cx: sx(i), cy: sy(Math.log10(v)), r: 2.5, fill: colour });
      dot.appendChild(svgElement("title", {})).textContent = `${CIRCUITS[spectrum.matrix].label}: σ${i} = ${formatNumber(v)}`;
      svg.appendChild(dot);
    }
  }
  const entries = state.head === ALL_HEADS
    ? [...Array(DATA.num_heads).keys()].map((h) => ["head " + h + " (W_QK solid, W_OV dashed)", PALETTE[h % PALETTE.length]])
    : spectra.map((s) => [CIRCUITS[s.matrix].label, MATRIX_COLOURS[s.matrix]]);
  if (untrained.length > 0) entries.push([`dashed: the untrained parameters (step ${DATA.checkpoints[0].step})`, "#999"]);
  for (const [label, colour] of entries) legend.appendChild(legendEntry(label, colour));
}

// One row per (head, matrix): its effective rank, then its singular values.
function renderSpectrumTable(spectra) {
  const table = byId("spectrum-table");
  const width = Math.max(...spectra.map((s) => s.values.length));
  const header = element("tr");
  for (const name of ["head", "matrix", "effective rank"]) header.appendChild(element("th", name));
  for (let i = 1; i <= width; i++) header.appendChild(element("th", "σ" + i));
  table.tHead.replaceChildren(header);
  const body = table.tBodies[0];
  body.replaceChildren();
  for (const spectrum of spectra) {
    const row = element("tr");
    row.dataset.head = spectrum.head;
    row.dataset.matrix = spectrum.matrix;
    row.append(element("td", String(spectrum.head)), element("td", CIRCUITS[spectrum.matrix].label));
    row.appendChild(numberCell(spectrum.rank)).classList.add("rank");
    for (const value of spectrum.values) row.appendChild(numberCell(value)).classList.add("singular-value");
    body.appendChild(row);
  }
}

function renderSpectra() {
  const spectra = shownSpectra();
  byId("spectra").hidden = spectra.length === 0;
  if (spectra.length === 0) return;
  const shown = state.head === ALL_HEADS ? `${DATA.layers[state.layer]}, every head` : headLabel(state.layer, state.head);
  byId("spectrum-title").textContent =
    `Singular values, ${shown}, step ${DATA.checkpoints[state.checkpoint].step}`;
  byId("effective-rank").textContent = state.head === ALL_HEADS ? "effective ranks: the table below" : spectra
    .map((s) => `${CIRCUITS[s.matrix].label}: effective rank ${formatNumber(s.rank)} of ${s.values.length}`)
    .join("; ");
  renderSpectrumPlot(spectra);
  renderSpectrumTable(spectra);
}

function compositionMode() {
  return document.querySelector('input[name="composition-mode"]:checked').value;
}

// Rows: every head of the layers but the last; columns: every head of the layers but the first.
// A cell shows the composition of its row's head into its column's head (empty unless the row's
// layer comes first); shaded by the score over the largest score shown.
function renderComposition() {
  byId("composition").hidden = CIRCUITS.composition === null;
  if (CIRCUITS.composition === null) return;
  const mode = compositionMode();
  const scores = CIRCUITS.composition[mode][state.checkpoint];
  const heads = [...Array(DATA.num_heads).keys()];
  const layers = DATA.layers.map((_, l) => l);
  const pairs = (ls) => ls.flatMap((l) => heads.map((h) => [l, h]));
  const sources = pairs(layers.slice(0, -1));
  const targets = pairs(layers.slice(1));
  let largest = 0;
  for (const [l1, h1] of sources) for (const [l2, h2] of targets) if (l1 < l2) largest = Math.max(largest, scores[l1][h1][l2][h2]);
  byId("composition-title").textContent =
    `${mode}-composition scores, step ${DATA.checkpoints[state.checkpoint].step}`;
  const table = byId("composition-table");
  const header = element("tr");
  header.appendChild(element("th", "from \\ into"));
  for (const [l2, h2] of targets) header.appendChild(element("th", headLabel(l2, h2)));
  table.tHead.replaceChildren(header);
  const body = table.tBodies[0];
  body.replaceChildren();
  for (const [l1, h1] of sources) {
    const row = element("tr");
    row.appendChild(element("th", headLabel(l1, h1)));
    for (const [l2, h2] of targets) {
      const selected = (l, h) => l === state.layer && (state.head === ALL_HEADS || h === state.head);
      if (l1 >= l2) {
        row.appendChild(element("td", "", "na"));
        continue;
      }
      const value = scores[l1][h1][l2][h2];
      const cell = row.appendChild(numberCell(value));
      Object.assign(cell.dataset, { sourceLayer: l1, sourceHead: h1, targetLayer: l2, targetHead: h2 });
      cell.style.background = `rgba(${ACCENT}, ${largest > 0 ? value / largest : 0})`;
      cell.style.color = largest > 0 && value / largest > 0.55 ? "#fff" : "";
      cell.classList.toggle("selected", selected(l1, h1) || selected(l2, h2));
      cell.title = `${headLabel(l1, h1)} into ${headLabel(l2, h2)}: ${mode}-composition ${formatNumber(value)}`;
      cell.addEventListener("click", () => selectView({ layer: l2, head: h2 }));
    }
    body.appendChild(row);
  }
}

// The patching heat map (layers down, heads across), or the note saying how to get one.
function renderPatching() {
  const patching = CIRCUITS.patching;
  const text = byId("patching-text");
  const table = byId("patching-table");
  table.hidden = patching === null;
  if (patching === null) {
    text.textContent = CIRCUITS.patching_note;
    return;
  }
  const quoted = (tokens) => '"' + tokens.map(visibleToken).join("") + '"';
  text.textContent =
    `Clean ${quoted(patching.clean)}, corrupted ${quoted(patching.corrupted)}, at step ${patching.step}. ` +
    `The answer "${visibleToken(patching.answer)}" is the model's most likely next token after the clean prompt, ` +
    `the contrast "${visibleToken(patching.contrast)}" after the corrupted one; logit(answer) - logit(contrast) ` +
    `at the last position is ${formatNumber(patching.clean_difference)} on the clean prompt and ` +
    `${formatNumber(patching.corrupted_difference)} on the corrupted one. Each cell: the share of that ` +
    "difference restored when, in the corrupted run, that head's output (its z, before W_O, at every " +
    "position) is replaced by its output on the clean prompt: (patched - corrupted) / (clean - corrupted); " +
    "1 restores all of it, 0 none. Click a cell to select the head.";
  const header = element("tr");
  header.appendChild(element("th", "layer"));
  for (let h = 0; h < DATA.num_heads; h++) header.appendChild(element("th", "head " + h));
  table.tHead.replaceChildren(header);
  const body = table.tBodies[0];
  body.replaceChildren();
  patching.restored.forEach((shares, layer) => {
    const row = element("tr");
    row.appendChild(element("th", DATA.layers[layer]));
    shares.forEach((share, head) => {
      const cell = row.appendChild(numberCell(share));
      Object.assign(cell.dataset, { layer, head });
      if (share !== null) {
        cell.style.background = `rgba(${share < 0 ? NEGATIVE : ACCENT}, ${Math.min(1, Math.abs(share))})`;
        cell.style.color = Math.abs(share) > 0.55 ? "#fff" : "";
      }
      cell.classList.toggle("selected", layer === state.layer && (state.head === ALL_HEADS || head === state.head));
      cell.addEventListener("click", () => selectView({ layer, head }));
    });
    body.appendChild(row);
  });
}

function renderCircuits() {
  if (CIRCUITS === null) return;
  renderSpectra();
  renderComposition();
  renderPatching();
}

function initCircuits() {
  byId("circuits").hidden = CIRCUITS === null;
  if (CIRCUITS === null) return;
  for (const note of CIRCUITS.notes) byId("circuit-notes").appendChild(element("li", note));
  for (const input of document.querySelectorAll('input[name="composition-mode"]')) {
    input.addEventListener("change", renderComposition);
  }
}

// ---- Selection: example, layer, head ------------------------------------------------------

function fillSelect(select, labels, values) {
  select.replaceChildren();
  labels.forEach((label, index) => {
    const option = element("option", label);
    option.value = values[index];
    select.appendChild(option);
  });
}

function selectView({ example = state.example, layer = state.layer, head = state.head }) {
  if (example !== state.example) {
    state.example = example;
    state.hovered = null;
    state.pinned = sizes(example).T - 1;
    renderTokens();
  }
  state.layer = layer;
  state.head = head;
  byId("example-select").value = String(example);
  byId("layer-select").value = String(layer);
  byId("head-select").value = String(head);
  for (const row of byId("diagnostics-table").tBodies[0].rows) {
    row.classList.toggle("selected", Number(row.dataset.layer) === layer && Number(row.dataset.head) === head);
  }
  renderStrip();
  setCheckpoint(state.checkpoint);
}

function initControls() {
  const heads = [...Array(DATA.num_heads).keys()];
  fillSelect(byId("example-select"), DATA.examples.map((example) => example.name), DATA.examples.map((_, e) => e));
  fillSelect(byId("layer-select"), DATA.layers, DATA.layers.map((_, l) => l));
  fillSelect(byId("head-select"), heads.map((h) => "head " + h).concat(["all heads"]), heads.concat([ALL_HEADS]));
  byId("example-select").addEventListener("change", (event) => selectView({ example: Number(event.target.value) }));
  byId("layer-select").addEventListener("change", (event) => selectView({ layer: Number(event.target.value) }));
  byId("head-select").addEventListener("change", (event) => {
    const value = event.target.value;
    selectView({ head: value === ALL_HEADS ? ALL_HEADS : Number(value) });
  });
  const slider = byId("checkpoint-slider");
  slider.max = DATA.checkpoints.length - 1;
  slider.addEventListener("input", () => setCheckpoint(Number(slider.value)));
  byId("play-button").addEventListener("click", togglePlay);
  const heatmap = byId("heatmap");
  heatmap.addEventListener("mousemove", showHeatmapValue);
  heatmap.addEventListener("mouseleave", () => (byId("heatmap-readout").textContent = "\u00a0"));
  heatmap.addEventListener("click", (event) => {
    const position = heatmapPosition(event);
    if (position !== null) setPinned(position.t);
  });
}

// ---- Diagnostics table ---------------------------------------------------------------------

function renderDiagnostics() {
  const table = byId("diagnostics-table");
  const columns = DATA.diagnostics.columns;
  const labels = DATA.diagnostics.labels || {};  // what a missing value shows as, by column
  const header = element("tr");
  for (const name of ["layer", "head", ...columns]) header.appendChild(element("th", name));
  table.tHead.replaceChildren(header);
  for (const row of DATA.diagnostics.rows) {
    const tr = element("tr");
    tr.dataset.layer = row.layer;
    tr.dataset.head = row.head;
    const layer = element("td", DATA.layers[row.layer]);
    layer.dataset.value = row.layer;
    tr.append(layer, element("td", String(row.head)));
    for (const name of columns) {
      const text = row[name] === null && name in labels ? labels[name] : formatNumber(row[name]);
      const cell = element("td", text);
      cell.dataset.value = row[name] === null ? "" : String(row[name]);
      tr.appendChild(cell);
    }
    tr.addEventListener("click", () => selectView({ layer: row.layer, head: row.head }));
    table.tBodies[0].appendChild(tr);
  }
  makeSortable(table);
}

// ---- Loss curves -----------------------------------------------------------------------------

// About `count` round tick values (1, 2 or 5 times a power of ten) covering [low, high].
function niceTicks(low, high, count) {
  const raw = (high - low) / count;
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * power).find((candidate) => candidate >= raw);
  const ticks = [];
  for (let tick = Math.ceil(low / step) * step; tick <= high + step * 1e-9; tick += step) ticks.push(tick);
  return ticks;
}

// log10 of the values 1, 2 and 5 times a power of ten within [10^low, 10^high]; the powers of
// ten alone when those are many.
function logTicks(low, high) {
  const ticks = [];
  for (let power = Math.floor(low); power <= Math.ceil(high); power++) {
    for (const m of [1, 2, 5]) {
      const tick = power + Math.log10(m);
      if (tick >= low - 1e-9 && tick <= high + 1e-9) ticks.push(tick);
    }
  }
  return ticks.length > 8 ? ticks.filter(Number.isInteger) : ticks;
}

function extent(values) {
  let low = Math.min(...values);
  let high = Math.max(...values);
  if (low === high) [low, high] = [low - 1, high + 1];
  return [low, high];
}

function drawAxes(svg, box, xTicks, yTicks, yLabel, xLabel = "step") {
  for (const [value, y] of yTicks) {
    svg.appendChild(svgElement("line", { x1: box.left, x2: box.right, y1: y, y2: y, class: "grid" }));
    svg.appendChild(svgElement("text", { x: box.left - 6, y: y + 4, "text-anchor": "end" })).textContent = yLabel(value);
  }
  for (const [value, x] of xTicks) {
    svg.appendChild(svgElement("line", { x1: x, x2: x, y1: box.bottom, y2: box.bottom + 4, class: "axis" }));
    svg.appendChild(svgElement("text", { x, y: box.bottom + 16, "text-anchor": "middle" })).textContent = String(value);
  }
  svg.appendChild(svgElement("line", { x1: box.left, x2: box.right, y1: box.bottom, y2: box.bottom, class: "axis" }));
  svg.appendChild(svgElement("line", { x1: box.left, x2: box.left, y1: box.top, y2: box.bottom, class: "axis" }));
  svg.appendChild(svgElement("text", { x: (box.left + box.right) / 2, y: box.bottom + 32, "text-anchor": "middle" }))
    .textContent = xLabel;
}

// Every curve as a polyline; with log y, values <= 0 are left out. Missing values (null) too.
function renderCurves() {
  const svg = byId("curve-plot");
  svg.replaceChildren();
  const logY = byId("log-y").checked;
  const toY = (value) => (logY ? Math.log10(value) : value);
  const series = Object.entries(DATA.curves).map(([name, points]) => [
    name, points.filter(([, value]) => value !== null && (!logY || value > 0)),
  ]);
  const points = series.flatMap(([, kept]) => kept);
  if (points.length === 0) {
    svg.appendChild(svgElement("text", { x: 20, y: 30 })).textContent = "no curves to show";
    return;
  }
  const box = { left: 64, right: 624, top: 12, bottom: 284 };
  const [x0, x1] = extent(points.map(([step]) => step));
  const [y0, y1] = extent(points.map(([, value]) => toY(value)));
  const sx = (x) => box.left + ((x - x0) / (x1 - x0)) * (box.right - box.left);
  const sy = (y) => box.bottom - ((y - y0) / (y1 - y0)) * (box.bottom - box.top);
  const yTicks = logY && y1 - y0 >= 1 ? niceTicks(y0, y1, 5).filter(Number.isInteger) : niceTicks(y0, y1, 5);
  drawAxes(svg, box, niceTicks(x0, x1, 6).map((x) => [x, sx(x)]), yTicks.map((y) => [y, sy(y)]),
    (y) => formatNumber(logY ? Math.pow(10, y) : y));
  const legend = byId("curve-legend");
  legend.replaceChildren();
  series.forEach(([name, kept], index) => {
    const colour = PALETTE[index % PALETTE.length];
    const line = svgElement("polyline", {
      points: kept.map(([x, y]) => `${sx(x).toFixed(1)},${sy(toY(y)).toFixed(1)}`).join(" "),
      fill: "none", stroke: colour, "stroke-width": 1.5, "data-name": name,
    });
    line.appendChild(svgElement("title", {})).textContent = name;
    svg.appendChild(line);
    legend.appendChild(legendEntry(name, colour));
  });
}

// ---- Header, notes, config -------------------------------------------------------------------

function configNode(key, value, depth) {
  if (value !== null && typeof value === "object") {
    const details = element("details");
    details.open = depth < 1;
    const size = Array.isArray(value) ? ` [${value.length}]` : "";
    details.appendChild(element("summary", key + size));
    for (const [childKey, child] of Object.entries(value)) details.appendChild(configNode(childKey, child, depth + 1));
    return details;
  }
  const leaf = element("div", undefined, "leaf");
  leaf.append(element("span", key + ": ", "key"), element("span", JSON.stringify(value)));
  return leaf;
}

function renderText() {
  byId("title").textContent = DATA.title;
  byId("subtitle").textContent = DATA.subtitle;
  for (const note of DATA.notes) byId("notes").appendChild(element("li", note));
  const tree = byId("config-tree");
  for (const [key, value] of Object.entries(DATA.config)) tree.appendChild(configNode(key, value, 0));
}

renderText();
renderCurves();
byId("log-y").addEventListener("change", renderCurves);
initControls();
initCircuits();
renderDiagnostics();
state.pinned = sizes(0).T - 1; // start on the last query: the one that predicts next
renderTokens();
selectView({});
