// What both pages share: the API key kept in this browser, calls that carry it, and the
// server's errors as it wrote them.
const KEY = "llmbus.apiKey";

export const $ = (selector) => document.querySelector(selector);

export function authHeaders(extra = {}) {
  const key = localStorage.getItem(KEY);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// fetch() with the key; a 401 opens the key form with the server's message.
export async function api(path, init = {}) {
  const response = await fetch(path, { ...init, headers: authHeaders(init.headers) });
  if (response.status === 401) {
    askForKey(await errorText(response.clone()));
  }
  return response;
}

// The `error.message` of an OpenAI-style body; a 503's Retry-After is added.
export async function errorText(response) {
  let message = `HTTP ${response.status}`;
  try {
    const body = await response.json();
    message = body?.error?.message || message;
  } catch { /* not JSON: keep the status */ }
  const retry = response.headers.get("Retry-After");
  if (response.status === 503 && retry) message += ` (retry in ${retry} s)`;
  return message;
}

let onKeySaved = () => {};

export function whenKeySaved(callback) { onKeySaved = callback; }

export function askForKey(message) {
  const form = $("#key-form");
  $("#key-message").textContent = message;
  form.hidden = false;
  $("#key-input").focus();
}

// The key form, under the header; hidden until a call is refused.
export function setUpKeyForm() {
  const form = document.createElement("form");
  form.id = "key-form";
  form.className = "notice";
  form.hidden = true;
  form.innerHTML = '<span id="key-message"></span><input id="key-input" type="password" '
    + 'placeholder="API key" autocomplete="off"><button type="submit">Save key</button>';
  document.querySelector("header").after(form);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    localStorage.setItem(KEY, $("#key-input").value.trim());
    $("#key-input").value = "";
    $("#key-form").hidden = true;
    onKeySaved();
  });
}
