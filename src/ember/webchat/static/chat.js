// The chat page: keeps the conversation, streams each answer over
// /v1/chat/completions, and shows per turn where the latency went.
//
// Every API call is relative ("v1/..."), so the page works the same served by
// `ember serve` or by `ember route` (whose /v1 routes to a replica). The
// conversation is sent whole every turn, with its X-Session-ID, so Ember can
// keep its KV state between turns: turn 2 onwards shows "hot" and its cached
// prompt tokens, and starts sooner.

import { renderMarkdown } from "./markdown.js";
import { DONE, errorMessage, readEvents, retryDelayMs } from "./sse.js";
import { turnEnding, turnStats } from "./stats.js";

const CHAT_URL = "v1/chat/completions";
const MODELS_URL = "v1/models";
const PRESETS = { support: 80, creative: 300 }; // the server's --profile presets
const DEFAULTS = { preset: "support", maxTokens: PRESETS.support, temperature: 0.7, system: "" };
// 429 and 503 answers waited out per turn before the page gives up and says so.
const MAX_RETRIES = 5;

const $ = (id) => document.getElementById(id);
const ui = {
  log: $("log"),
  input: $("input"),
  composer: $("composer"),
  send: $("send"),
  stop: $("stop"),
  newChat: $("new-chat"),
  settingsToggle: $("settings-toggle"),
  settings: $("settings"),
  preset: $("preset"),
  maxTokens: $("max-tokens"),
  temperature: $("temperature"),
  system: $("system"),
  apiKey: $("api-key"),
  sessionId: $("session-id"),
  notice: $("notice"),
  model: $("model"),
};

const state = {
  conversation: newConversation(),
  controller: null, // the AbortController of the turn in flight, if any
};

// ---------------------------------------------------------------------------
// Settings: kept in localStorage, the API key only for this tab (sessionStorage).
// ---------------------------------------------------------------------------

function stored(storage, key, fallback) {
  try {
    return storage.getItem(`ember.${key}`) ?? fallback;
  } catch {
    return fallback; // storage disabled
  }
}

function store(storage, key, value) {
  try {
    storage.setItem(`ember.${key}`, value);
  } catch {
    // storage disabled: the setting lasts until the page reloads
  }
}

function loadSettings() {
  ui.preset.value = stored(localStorage, "preset", DEFAULTS.preset);
  ui.maxTokens.value = stored(localStorage, "maxTokens", String(DEFAULTS.maxTokens));
  ui.temperature.value = stored(localStorage, "temperature", String(DEFAULTS.temperature));
  ui.system.value = stored(localStorage, "system", DEFAULTS.system);
  ui.apiKey.value = stored(sessionStorage, "apiKey", "");
}

function saveSettings() {
  store(localStorage, "preset", ui.preset.value);
  store(localStorage, "maxTokens", ui.maxTokens.value);
  store(localStorage, "temperature", ui.temperature.value);
  store(localStorage, "system", ui.system.value);
  store(sessionStorage, "apiKey", ui.apiKey.value);
}

function requestSettings() {
  const maxTokens = parseInt(ui.maxTokens.value, 10);
  const temperature = parseFloat(ui.temperature.value);
  const settings = {};
  if (Number.isFinite(maxTokens) && maxTokens > 0) settings.max_tokens = maxTokens;
  if (Number.isFinite(temperature) && temperature >= 0 && temperature <= 2) settings.temperature = temperature;
  return settings;
}

function authHeaders() {
  const key = ui.apiKey.value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function openSettings(open, focus) {
  ui.settings.hidden = !open;
  ui.settingsToggle.setAttribute("aria-expanded", String(open));
  if (open && focus) focus.focus();
}

// ---------------------------------------------------------------------------
// The conversation and its view
// ---------------------------------------------------------------------------

function newConversation() {
  const bytes = new Uint8Array(12);
  crypto.getRandomValues(bytes); // randomUUID needs a secure context; a LAN http:// page is not one
  return { sessionId: `web-${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`, messages: [] };
}

function startNewConversation() {
  state.controller?.abort();
  state.conversation = newConversation();
  ui.log.replaceChildren();
  ui.sessionId.textContent = state.conversation.sessionId;
  showNotice(null);
  ui.input.focus();
}

function showNotice(text) {
  ui.notice.hidden = !text;
  ui.notice.textContent = text ?? "";
}

/** Keep the newest text in view, unless the reader scrolled up to read. */
function following(update) {
  const log = ui.log;
  const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 48;
  update();
  if (atBottom) log.scrollTop = log.scrollHeight;
}

function addUserMessage(text) {
  const article = document.createElement("article");
  article.className = "msg user";
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  article.append(body);
  following(() => ui.log.append(article));
  return article;
}

/** The assistant's side of one turn: its text, a status line and the stats line. */
class TurnView {
  constructor() {
    this.article = document.createElement("article");
    this.article.className = "msg assistant";
    this.article.dataset.state = "sending";
    this.text = document.createElement("div");
    this.text.className = "text";
    this.status = document.createElement("div");
    this.status.className = "status";
    this.status.hidden = true;
    this.stats = document.createElement("div");
    this.stats.className = "stats";
    this.article.append(this.text, this.status, this.stats);
    following(() => ui.log.append(this.article));
  }

  setState(name) {
    this.article.dataset.state = name;
  }

  showText(markdown) {
    following(() => this.text.replaceChildren(renderMarkdown(markdown)));
  }

  showStatus(kind, text) {
    this.status.hidden = !text;
    this.status.className = `status ${kind ?? ""}`;
    this.status.textContent = text ?? "";
  }

  showResult(turn) {
    const spans = turnStats(turn).map(({ key, text, title, tier }) => {
      const span = document.createElement("span");
      span.dataset.stat = key;
      span.textContent = text;
      span.title = title;
      if (tier) span.className = `tier tier-${tier}`;
      return span;
    });
    const ending = turnEnding(turn);
    following(() => {
      this.stats.replaceChildren(...spans);
      this.showStatus(ending?.kind, ending?.text);
    });
    this.setState(ending ? ending.kind : "done");
  }
}

// ---------------------------------------------------------------------------
// One turn: send, wait out 429/503, stream
// ---------------------------------------------------------------------------

async function send() {
  const text = ui.input.value;
  if (!text.trim() || state.controller) return;
  const conversation = state.conversation;
  ui.input.value = "";
  const userMessage = addUserMessage(text);
  conversation.messages.push({ role: "user", content: text });
  const view = new TurnView();
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let turn;
  try {
    turn = await runTurn(conversation, view, controller.signal);
  } finally {
    state.controller = null;
    setBusy(false);
  }
  view.showResult(turn);
  if (conversation !== state.conversation) return; // a new conversation started meanwhile
  if (turn.text || (!turn.error && !turn.stopped)) {
    // Even a partial answer stays in the history: it is what the person saw.
    conversation.messages.push({ role: "assistant", content: turn.text });
  } else {
    // Nothing came back: take the question out of the history, and give it back to edit or resend.
    conversation.messages.pop();
    userMessage.classList.add("unsent");
    if (!ui.input.value) ui.input.value = text;
  }
  if (turn.needsKey) {
    showNotice("This server needs an API key: enter it in Settings, then send again.");
    openSettings(true, ui.apiKey);
  }
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.hidden = !busy;
}

function newTurn() {
  return { text: "", ttftMs: null, firstAt: null, lastAt: null, chunks: 0, usage: null, finish: null, stopReason: null, stopped: false, error: null, waits: [], maxTokens: null, clamped: false, degraded: false, needsKey: false };
}

async function runTurn(conversation, view, signal) {
  const turn = newTurn();
  const system = ui.system.value.trim();
  const body = JSON.stringify({
    messages: system ? [{ role: "system", content: system }, ...conversation.messages] : conversation.messages,
    stream: true,
    stream_options: { include_usage: true },
    ...requestSettings(),
  });
  for (;;) {
    const sentAt = performance.now();
    let response;
    try {
      response = await fetch(CHAT_URL, {
        method: "POST",
        headers: { "Content-Type": "application/json", "X-Session-ID": conversation.sessionId, ...authHeaders() },
        body,
        signal,
      });
    } catch (err) {
      if (signal.aborted) turn.stopped = true;
      else turn.error = `could not reach the server (${err.message})`;
      return turn;
    }
    if (response.status === 429 || response.status === 503) {
      const waitMs = retryDelayMs(response.headers);
      const message = await errorMessage(response);
      if (waitMs === null || turn.waits.length >= MAX_RETRIES) {
        turn.error = `${response.status}: ${message}`;
        return turn;
      }
      view.setState("waiting");
      if (!(await waitOut(view, waitMs, response.status, message, signal))) {
        turn.stopped = true;
        return turn;
      }
      turn.waits.push({ status: response.status, ms: waitMs });
      view.showStatus(null, null);
      continue;
    }
    if (!response.ok) {
      turn.error = `${response.status}: ${await errorMessage(response)}`;
      turn.needsKey = response.status === 401;
      return turn;
    }
    turn.maxTokens = parseInt(response.headers.get("x-ember-max-tokens") ?? "", 10) || null;
    turn.clamped = response.headers.get("x-ember-max-tokens-clamped") === "1";
    turn.degraded = response.headers.get("x-ember-degraded") === "1";
    view.setState("streaming");
    await streamAnswer(response, turn, view, sentAt, signal);
    return turn;
  }
}

/** Read the SSE stream into `turn`, showing the text as it grows. */
async function streamAnswer(response, turn, view, sentAt, signal) {
  try {
    for await (const event of readEvents(response.body)) {
      if (event === DONE) break;
      if (event.error) {
        // An error after the stream started: an error chunk, then [DONE].
        turn.error = event.error.message || "the server reported an error";
        continue;
      }
      if (event.usage) turn.usage = event.usage;
      const choice = event.choices?.[0];
      if (!choice) continue;
      const delta = choice.delta?.content;
      if (delta) {
        const now = performance.now();
        if (turn.firstAt === null) {
          turn.firstAt = now;
          turn.ttftMs = now - sentAt;
        }
        turn.lastAt = now;
        turn.chunks += 1;
        turn.text += delta;
        view.showText(turn.text);
      }
      if (choice.finish_reason) {
        turn.finish = choice.finish_reason;
        turn.stopReason = choice.stop_reason ?? null;
      }
    }
  } catch (err) {
    if (signal.aborted) turn.stopped = true;
    else turn.error = `the connection broke (${err.message})`;
  }
}

/** Count down the server's Retry-After; true once it has passed, false if the person stopped. */
function waitOut(view, ms, status, message, signal) {
  view.article.dataset.waitMs = String(Math.round(ms));
  view.article.dataset.waitStatus = String(status);
  const what = status === 429 ? "Server busy" : "Server unavailable";
  return new Promise((resolve) => {
    const until = performance.now() + ms;
    let timer = null;
    const end = (passed) => {
      clearInterval(timer);
      signal.removeEventListener("abort", onAbort);
      resolve(passed);
    };
    const onAbort = () => end(false);
    const tick = () => {
      const left = until - performance.now();
      if (left <= 0) return end(true);
      view.showStatus("wait", `${what} (${status}): ${message} Retrying in ${Math.ceil(left / 1000)} s…`);
    };
    if (signal.aborted) return resolve(false);
    signal.addEventListener("abort", onAbort, { once: true });
    timer = setInterval(tick, 200);
    tick();
  });
}

// ---------------------------------------------------------------------------
// The model's name, and whether the server wants a key
// ---------------------------------------------------------------------------

async function loadModel() {
  try {
    const response = await fetch(MODELS_URL, { headers: authHeaders() });
    if (response.status === 401) {
      ui.model.textContent = "";
      showNotice("This server needs an API key: enter it in Settings.");
      openSettings(true, ui.apiKey);
      return;
    }
    const listing = response.ok ? await response.json() : null;
    ui.model.textContent = listing?.data?.[0]?.id ?? "";
    showNotice(null);
  } catch {
    ui.model.textContent = "(server unreachable)";
  }
}

// ---------------------------------------------------------------------------
// Wiring
// ---------------------------------------------------------------------------

function wire() {
  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  ui.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && state.controller) {
      event.preventDefault();
      state.controller.abort();
    }
  });
  ui.stop.addEventListener("click", () => state.controller?.abort());
  ui.newChat.addEventListener("click", startNewConversation);
  ui.settingsToggle.addEventListener("click", () => openSettings(ui.settings.hidden, null));
  ui.settings.addEventListener("submit", (event) => event.preventDefault()); // Enter in a field sends nothing
  ui.preset.addEventListener("change", () => {
    if (ui.preset.value in PRESETS) ui.maxTokens.value = String(PRESETS[ui.preset.value]);
    saveSettings();
  });
  ui.maxTokens.addEventListener("input", () => {
    const preset = Object.keys(PRESETS).find((name) => String(PRESETS[name]) === ui.maxTokens.value);
    ui.preset.value = preset ?? "custom";
    saveSettings();
  });
  for (const field of [ui.temperature, ui.system]) field.addEventListener("input", saveSettings);
  ui.apiKey.addEventListener("change", () => {
    saveSettings();
    loadModel();
  });
}

loadSettings();
wire();
ui.sessionId.textContent = state.conversation.sessionId;
loadModel();
