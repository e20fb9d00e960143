// llmc's chat page: streams answers from /v1/chat/completions (server-sent events), no build step, no dependencies.
"use strict";
const $ = (id) => document.getElementById(id);
const history = [];  // the conversation sent with each request: {role, content}
let controller = null;  // the running request's AbortController (the stop button aborts it)
let modelName = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = false;
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

function note(div, text) {
  const span = document.createElement("span");
  span.className = "note";
  span.textContent = text;
  div.appendChild(span);
}

async function errorMessage(resp) {
  // the server's OpenAI error body, {"error": {"message": ...}}; whatever came otherwise
  const body = await resp.text();
  try { return JSON.parse(body).error.message; } catch { return body || resp.statusText; }
}

function number(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (modelName) body.model = modelName;
  for (const id of ["temperature", "top_p", "top_k", "max_tokens", "seed"]) {
    const v = number(id);
    if (v !== undefined) body[id] = v;
  }
  return body;
}

// Reads the SSE stream into `div`; returns the finish reason, or throws on an error event.
async function readStream(resp, div) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", reason = null, usage = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return { reason, usage };
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        if (choice.delta && choice.delta.content) {
          div.textContent += choice.delta.content;
          $("log").scrollTop = $("log").scrollHeight;
        }
        if (choice.finish_reason) reason = choice.finish_reason;
      }
    }
  }
  return { reason, usage };
}

async function send(text) {
  $("error").hidden = true;
  history.push({ role: "user", content: text });
  const question = bubble("user", text);
  const div = bubble("assistant", "");
  div.classList.add("streaming");
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  try {
    const resp = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!resp.ok) {  // refused: the question goes back in the box, to fix the settings and send again
      history.pop();
      div.remove();
      question.remove();
      if (!$("prompt").value) $("prompt").value = text;
      showError(`Error ${resp.status}: ${await errorMessage(resp)}`);
      return;
    }
    const { reason, usage } = await readStream(resp, div);
    history.push({ role: "assistant", content: div.textContent });
    const secs = (performance.now() - started) / 1000;
    if (usage) $("stats").textContent = `${usage.completion_tokens} tokens in ${secs.toFixed(1)} s`;
    if (reason === "length") note(div, "(stopped at max tokens)");
  } catch (e) {
    if (e.name === "AbortError") {
      note(div, "(stopped)");
      history.push({ role: "assistant", content: div.textContent });
    } else {
      history.pop();
      showError(`Error: ${e.message}`);
    }
  } finally {
    div.classList.remove("streaming");
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  history.length = 0;
  $("log").replaceChildren();
  $("error").hidden = true;
});

fetch("v1/models", { headers: headers() })
  .then((r) => (r.ok ? r.json() : Promise.reject(new Error(`models: HTTP ${r.status}`))))
  .then((list) => {
    const m = list.data[0];
    modelName = m.id;
    $("model").textContent = `${m.id} (context ${m.max_model_len} tokens)`;
    document.title = `llmc chat · ${m.id}`;
  })
  .catch(() => { $("model").textContent = "model unknown (set the API key?)"; });
