// The pipeline page: every stage's live copies, the engines' load and the recent requests,
// polled from /v1/pipeline every second. Copies come and go as heartbeats start and stop.
import { $, api, errorText, setUpKeyForm, whenKeySaved } from "./common.js";

const POLL_MS = 1000;

const percent = (x) => (x == null ? "–" : `${(100 * x).toFixed(0)}%`);
const fixed = (x, digits = 1) => (x == null ? "–" : x.toFixed(digits));
const seconds = (x) => (x == null ? "–" : x < 1 ? `${Math.round(1000 * x)} ms` : `${x.toFixed(1)} s`);

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

const adapters = (names) => cell(names?.length ? names.join(", ") : "–", "adapters");

function engineCells(engine) {
  return [cell(engine.role), cell(`${engine.num_running} / ${engine.num_waiting}`),
    cell(percent(engine.kv_usage)), cell(percent(engine.prefix_hit_rate)),
    cell(fixed(engine.tokens_per_second)), adapters(engine.adapters)];
}

function stageCard(stage) {
  const card = document.createElement("article");
  card.className = "stage";
  card.dataset.stage = stage.name;
  const isEngine = stage.name === "scheduler", isExecutor = stage.name === "executor";
  const heads = ["copy", "engine", "heartbeat", "handled",
    ...(isEngine ? ["role", "running / waiting", "KV used", "prefix hits", "tok/s"] : []),
    ...(isEngine || isExecutor ? ["adapters"] : [])];
  card.innerHTML = `<h2></h2><table><thead><tr></tr></thead><tbody></tbody></table>`;
  card.querySelector("h2").textContent = `${stage.name} · ${stage.copies.length}`;
  card.querySelector("tr").append(...heads.map((h) => {
    const th = document.createElement("th");
    th.textContent = h;
    return th;
  }));
  for (const copy of stage.copies) {
    const row = document.createElement("tr");
    row.className = "copy";
    row.dataset.instance = copy.instance_id;
    const engine = (copy.engine_id ?? "") + (copy.shard ? ` (shard ${copy.shard})` : "");
    row.append(cell(copy.instance_id), cell(engine),
      cell(seconds(copy.heartbeat_age_seconds), copy.heartbeat_age_seconds > 2 ? "late" : ""),
      cell(String(copy.num_handled)), ...(copy.engine ? engineCells(copy.engine) : []),
      ...(isExecutor ? [adapters(copy.adapters)] : []));
    card.querySelector("tbody").append(row);
  }
  if (!stage.copies.length) card.classList.add("empty");
  return card;
}

function requestRow(request) {
  const row = document.createElement("tr");
  row.dataset.status = request.status;
  const trace = document.createElement("td");
  if (request.trace_url) {
    const link = document.createElement("a");
    link.href = request.trace_url;
    link.target = "_blank";
    link.rel = "noopener noreferrer";
    link.textContent = request.trace_id.slice(0, 8);
    trace.append(link);
  } else {
    trace.textContent = request.trace_id ? request.trace_id.slice(0, 8) : "–";
  }
  const status = request.finish_reason ? `${request.status} (${request.finish_reason})`
    : request.status;
  row.append(cell(request.id), cell(request.replica), cell(status, `status ${request.status}`),
    cell(String(request.num_prompt_tokens)), cell(String(request.num_output_tokens)),
    cell(seconds(request.ttft_seconds)), cell(seconds(request.seconds)), trace);
  return row;
}

async function poll() {
  try {
    const response = await api("/v1/pipeline");
    if (!response.ok) throw new Error(await errorText(response));
    const view = await response.json();
    $("#model").textContent = view.model ?? "(no engine yet)";
    $("#stages").replaceChildren(...view.stages.map(stageCard));
    $("#recent tbody").replaceChildren(...view.recent_requests.map(requestRow));
    $("#updated").textContent = `updated ${new Date().toLocaleTimeString()} by api ${view.replica}`;
    $("#error").hidden = true;
  } catch (error) {
    $("#error").textContent = error.message;
    $("#error").hidden = false;
  }
}

setUpKeyForm();
whenKeySaved(poll);
poll();
setInterval(poll, POLL_MS);
