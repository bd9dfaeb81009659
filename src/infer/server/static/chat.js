// The chat page. The conversation is `history` (OpenAI messages), sent whole with each
// request; each reply streams from /v1/chat/completions as server-sent events.
// URLs are relative, so the page also works behind a proxy under a sub-path.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "api_key"];
let history = []; // replaced (not emptied) by New chat: a reply still streaming keeps its own
let model = null; // the served model's name, from GET v1/models
let controller = null; // aborts the reply being streamed; null when idle

function headers() {
  const key = $("api_key").value.trim();
  return { "Content-Type": "application/json", ...(key && { Authorization: `Bearer ${key}` }) };
}

// The message of an OpenAI-style error body ({"error": {"message": ...}}), else the status.
async function errorText(response) {
  const body = await response.text();
  try {
    return JSON.parse(body).error.message;
  } catch {
    return `${response.status} ${response.statusText} ${body}`.trim();
  }
}

async function loadModel() {
  try {
    const response = await fetch("v1/models", { headers: headers() });
    if (!response.ok) throw new Error(await errorText(response));
    model = (await response.json()).data[0].id;
    $("model").textContent = model;
  } catch (error) {
    model = null;
    $("model").textContent = `unavailable: ${error.message}`;
  }
}

function requestBody() {
  const number = (id, parse) => {
    const value = parse($(id).value);
    return Number.isNaN(value) ? undefined : value; // undefined fields are left out
  };
  const system = $("system").value.trim();
  return {
    model: model ?? undefined,
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    temperature: number("temperature", parseFloat),
    top_p: number("top_p", parseFloat),
    max_tokens: number("max_tokens", (v) => parseInt(v, 10)),
    stream: true,
    stream_options: { include_usage: true },
  };
}

// Yields the JSON of each `data:` line of the response until `data: [DONE]`.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const lines = buffer.split("\n");
    buffer = lines.pop(); // an unfinished line waits for the next read
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.textContent = text;
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function showStats(tokens, start, note = "") {
  const seconds = (performance.now() - start) / 1000;
  const rate = seconds > 0 ? (tokens / seconds).toFixed(1) : "–";
  $("stats").textContent = `${tokens} tokens in ${seconds.toFixed(1)} s, ${rate} tokens/s ${note}`;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

async function send(text) {
  const turn = history;
  turn.push({ role: "user", content: text });
  const question = addMessage("user", text);
  const bubble = addMessage("assistant", "");
  const box = $("messages");
  const start = performance.now();
  let reply = "";
  let chunks = 0; // about one token each; the usage event at the end has the exact count
  let usage = null;
  let note = "";
  // The reply is drawn at most once a frame: drawn at every chunk, a long reply's markdown
  // was parsed again per token and kept the page too busy to take a click on Stop.
  let frame = 0;
  const draw = () => {
    frame = 0;
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    bubble.innerHTML = renderMarkdown(reply);
    if (atBottom) box.scrollTop = box.scrollHeight;
    showStats(chunks, start);
  };
  controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const event of events(response)) {
      if (event.error) throw new Error(event.error.message); // an error after the 200
      usage = event.usage ?? usage;
      const delta = event.choices?.[0]?.delta?.content;
      if (!delta) continue;
      reply += delta;
      chunks += 1;
      if (!frame) frame = requestAnimationFrame(draw);
    }
  } catch (error) {
    if (error.name === "AbortError") note = "(stopped)";
    else addMessage("error", error.message);
  }
  if (frame) { // the last chunks, drawn now
    cancelAnimationFrame(frame);
    draw();
  }
  controller = null;
  setBusy(false);
  if (turn !== history) return; // New chat was pressed meanwhile
  showStats(usage ? usage.completion_tokens : chunks, start, note);
  if (reply) {
    turn.push({ role: "assistant", content: reply });
  } else { // a turn without a reply leaves the history; its text goes back to the input
    turn.pop();
    bubble.remove();
    question.classList.add("unsent");
    if (!$("input").value) $("input").value = text;
  }
}

function newChat() {
  controller?.abort();
  history = [];
  $("messages").replaceChildren();
  $("stats").textContent = "";
  $("input").focus();
}

for (const id of SETTINGS) {
  const saved = localStorage.getItem(`infer.${id}`);
  if (saved !== null) $(id).value = saved;
  $(id).addEventListener("input", () => localStorage.setItem(`infer.${id}`, $(id).value));
}
$("api_key").addEventListener("change", loadModel);
$("new-chat").addEventListener("click", newChat);
$("stop").addEventListener("click", () => controller?.abort());
$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
loadModel();
$("input").focus();
