// The chat page: a conversation kept in this browser, answers streamed from
// /v1/chat/completions (the route any client uses), a stop button that ends the request on
// the server (closing the stream is the server's abort), settings, per-answer speed, and a
// model picker: the base model or one of its LoRA adapters, as /v1/models lists them.
import { $, api, errorText, setUpKeyForm, whenKeySaved } from "./common.js";
import { renderMarkdown } from "./markdown.js";

const CHAT = "llmbus.chat";
const SETTINGS = "llmbus.settings";
const MODEL = "llmbus.model";  // the model picked last, kept while /v1/models lists it
const FIELDS = ["system", "temperature", "top_p", "max_tokens"];

let messages = JSON.parse(localStorage.getItem(CHAT) || "[]");
let running = null;  // the AbortController of the answer being streamed
let listed = false;  // the picker holds /v1/models' answer

const save = () => localStorage.setItem(CHAT, JSON.stringify(messages));

function statsText(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.tokens != null) parts.push(`${stats.exact ? "" : "≥"}${stats.tokens} tokens`);
  if (stats.tokensPerSecond != null) parts.push(`${stats.tokensPerSecond.toFixed(1)} tok/s`);
  if (stats.ttftMs != null) parts.push(`TTFT ${Math.round(stats.ttftMs)} ms`);
  if (stats.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function bubble(message) {
  const item = document.createElement("article");
  item.innerHTML = '<div class="body"></div><div class="stats muted"></div>';
  fill(item, message);
  return item;
}

function fill(item, message) {
  item.className = `message ${message.role}${message.error ? " error" : ""}`;
  const body = item.querySelector(".body");
  if (message.error) body.textContent = message.error;
  else if (message.role === "assistant") body.innerHTML = renderMarkdown(message.content);
  else body.textContent = message.content;
  item.querySelector(".stats").textContent = statsText(message.stats);
}

function render() {
  $("#messages").replaceChildren(...messages.map(bubble));
  $("#messages").lastElementChild?.scrollIntoView({ block: "end" });
}

function settings() {
  const body = {};
  for (const name of ["temperature", "top_p", "max_tokens"]) {
    const value = $(`#${name}`).value.trim();
    if (value !== "") body[name] = Number(value);  // sent as typed: the server judges it
  }
  return body;
}

function history() {
  const system = $("#system").value.trim();
  const turns = messages.filter((m) => !m.error && m.content)
    .map(({ role, content }) => ({ role, content }));
  return system ? [{ role: "system", content: system }, ...turns] : turns;
}

// Server-Sent Events from a fetch body: `data: {...}` events, `data: [DONE]` at the end.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    // Lines may end in \r\n, \n or \r; a \r that ends this read may be half of a \r\n.
    buffer += value;
    const cut = buffer.endsWith("\r") ? buffer.length - 1 : buffer.length;
    buffer = buffer.slice(0, cut).replace(/\r\n?/g, "\n") + buffer.slice(cut);
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trim()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

async function send(text) {
  messages.push({ role: "user", content: text });
  const answer = { role: "assistant", content: "", stats: null };
  const body = { messages: history(), stream: true, stream_options: { include_usage: true },
    ...settings() };
  messages.push(answer);
  save();
  render();
  const item = $("#messages").lastElementChild;
  const startedAt = performance.now();
  let firstAt = null, chunks = 0, usage = null;
  running = new AbortController();
  setRunning(true);
  try {
    body.model = await modelName();
    const response = await api("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), signal: running.signal,
      headers: { "Content-Type": "application/json" },
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        firstAt ??= performance.now();
        chunks += 1;
        answer.content += delta;
        fill(item, answer);
        item.scrollIntoView({ block: "end" });
      }
    }
  } catch (error) {
    if (error.name === "AbortError") answer.stopped = true;
    else answer.error = answer.content ? `${answer.content}\n\n[${error.message}]` : error.message;
  } finally {
    const tokens = usage ? usage.completion_tokens : chunks;
    const seconds = firstAt ? (performance.now() - firstAt) / 1000 : 0;
    answer.stats = answer.error && !firstAt ? null : { tokens, exact: usage != null,
      stopped: answer.stopped, ttftMs: firstAt ? firstAt - startedAt : null,
      // Known only with the usage chunk: one delta may carry several tokens.
      tokensPerSecond: usage && tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : null };
    fill(item, answer);
    running = null;
    setRunning(false);
    save();
    showModels();  // adapters come and go: the picker follows
  }
}

function setRunning(on) {
  $("#send").hidden = on;
  $("#stop").hidden = !on;
  document.body.dataset.state = on ? "streaming" : "idle";
}

// The picker's options: the base model first, then its adapters (`parent` set); the choice
// stays where it is (or was, before a reload) while it is listed, else the base.
async function listModels() {
  const response = await api("/v1/models");
  if (!response.ok) throw new Error(await errorText(response));
  const { data } = await response.json();
  const picker = $("#model");
  const wanted = picker.value || localStorage.getItem(MODEL);
  picker.replaceChildren(...data.map((m) => {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.parent ? `${m.id} (LoRA)` : m.id;
    return option;
  }));
  if (data.some((m) => m.id === wanted)) picker.value = wanted;
  listed = true;
}

async function modelName() {
  if (!listed) await listModels();
  return $("#model").value;
}

const showModels = () => listModels().catch(() => {});  // a 401 opens the key form

function setUp() {
  const saved = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
  for (const name of FIELDS) {
    $(`#${name}`).value = saved[name] ?? "";
    $(`#${name}`).addEventListener("change", () => {
      localStorage.setItem(SETTINGS, JSON.stringify(
        Object.fromEntries(FIELDS.map((f) => [f, $(`#${f}`).value]))));
    });
  }
  $("#composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("#prompt").value.trim();
    if (!text || running) return;
    $("#prompt").value = "";
    send(text);
  });
  $("#prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("#composer").requestSubmit();
    }
  });
  $("#stop").addEventListener("click", () => running?.abort());
  $("#new-chat").addEventListener("click", () => {
    running?.abort();
    messages = [];
    save();
    render();
  });
  $("#model").addEventListener("change", () => localStorage.setItem(MODEL, $("#model").value));
  $("#model").addEventListener("pointerenter", showModels);  // before it opens: fresh
  setUpKeyForm();
  whenKeySaved(showModels);
  render();
  showModels();
  setRunning(false);
}

setUp();
