// The chat page: one conversation streamed from /v1/chat/completions.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];
let controller = null;

async function loadModels() {
  let response;
  try {
    response = await api("/v1/models");
  } catch (e) {
    if (!(e instanceof AuthError)) setStatus(`Cannot list models: ${e.message}`, true);
    return;
  }
  if (!response.ok) {
    setStatus(`Cannot list models: ${await errorMessage(response)}`, true);
    return;
  }
  const models = (await response.json()).data;
  const select = $("model");
  select.replaceChildren(
    ...models.map((m) => {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = m.id;
      option.dataset.maxModelLen = m.max_model_len ?? "";
      return option;
    }),
  );
  showModelInfo();
  setStatus(`${models.length} model${models.length === 1 ? "" : "s"} served.`);
}

function showModelInfo() {
  const option = $("model").selectedOptions[0];
  $("model-info").textContent =
    option && option.dataset.maxModelLen ? `context: ${option.dataset.maxModelLen} tokens` : "";
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  const meta = document.createElement("div");
  meta.className = "meta";
  div.append(label, content, meta);
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function readNumber(id, parse) {
  const value = parse($(id).value);
  if (!Number.isFinite(value)) throw new Error(`${$(id).labels[0].textContent} must be a number`);
  return value;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const body = {
    model: $("model").value,
    messages,
    temperature: readNumber("temperature", parseFloat),
    top_p: readNumber("top-p", parseFloat),
    max_tokens: readNumber("max-tokens", (v) => parseInt(v, 10)),
    stream: true,
    stream_options: { include_usage: true },
  };
  const extra = $("extra").value.trim();
  if (extra) {
    let fields;
    try {
      fields = JSON.parse(extra);
    } catch (e) {
      throw new Error(`Extra request fields: ${e.message}`);
    }
    if (typeof fields !== "object" || fields === null || Array.isArray(fields)) {
      throw new Error("Extra request fields must be a JSON object");
    }
    Object.assign(body, fields);
  }
  return body;
}

// Each server-sent event's JSON, until "data: [DONE]".
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const parts = buffer.split("\n\n");
    buffer = parts.pop();
    for (const part of parts) {
      for (const line of part.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  let body;
  conversation.push({ role: "user", content: text });
  try {
    body = requestBody();
  } catch (e) {
    conversation.pop();
    setStatus(e.message, true);
    return;
  }
  $("prompt").value = "";
  const question = addMessage("user", text);
  const reply = addMessage("assistant", "");
  const content = reply.querySelector(".content");
  reply.classList.add("streaming");
  reply.dataset.chunks = "0";
  controller = new AbortController();
  setBusy(true);
  setStatus("Generating…");
  const started = performance.now();
  let firstToken = null;
  let finishReason = null;
  let usage = null;
  let answer = "";
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const event of events(response)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      const choice = event.choices && event.choices[0];
      if (!choice) continue;
      const delta = choice.delta && choice.delta.content;
      if (delta) {
        firstToken ??= performance.now();
        answer += delta;
        content.textContent = answer;
        reply.dataset.chunks = String(Number(reply.dataset.chunks) + 1);
        reply.scrollIntoView({ block: "end" });
      }
      if (choice.finish_reason) finishReason = choice.finish_reason;
    }
    setStatus("");
  } catch (e) {
    if (e.name === "AbortError") {
      finishReason = "stopped";
      setStatus("Stopped.");
    } else {
      finishReason = "error";
      setStatus(e instanceof AuthError ? "Enter the API key above, then send again." : e.message, true);
    }
  } finally {
    controller = null;
    setBusy(false);
  }
  reply.classList.remove("streaming");
  reply.dataset.finishReason = finishReason ?? "";
  reply.querySelector(".meta").textContent = describe(started, firstToken, usage, finishReason);
  if (answer) {
    conversation.push({ role: "assistant", content: answer });
  } else {
    // Nothing came back: take the message back into the box, to send again.
    conversation.pop();
    question.remove();
    reply.remove();
    if (!$("prompt").value) $("prompt").value = text;
  }
}

function describe(started, firstToken, usage, finishReason) {
  const parts = [];
  if (firstToken !== null) parts.push(`first token ${formatSeconds((firstToken - started) / 1000)}`);
  if (usage) {
    parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} generated tokens`);
    const seconds = (performance.now() - (firstToken ?? started)) / 1000;
    if (usage.completion_tokens > 1 && seconds > 0) {
      parts.push(`${formatNumber((usage.completion_tokens - 1) / seconds)} tokens/s`);
    }
  }
  if (finishReason) parts.push(`finish: ${finishReason}`);
  return parts.join(" · ");
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.classList.toggle("busy", busy);
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("new-chat").addEventListener("click", () => {
  if (controller) controller.abort();
  conversation.length = 0;
  $("messages").replaceChildren();
  setStatus("");
});
$("model").addEventListener("change", showModelInfo);
onKeyForm(loadModels);
loadModels();
