// The deepwell playground: plain browser JavaScript, no build step, nothing fetched from
// outside this server. Every API call carries the key typed into the page.
"use strict";

const $ = (selector) => document.querySelector(selector);

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  // textContent, never innerHTML: a user-typed control spelling must stay text.
  if (text !== undefined) node.textContent = text;
  return node;
}

// --- server calls ---

function headers() {
  const key = $("#api-key").value.trim();
  const out = { "Content-Type": "application/json" };
  if (key) {
    // OpenAI routes read the bearer token, Anthropic routes x-api-key; send both.
    out["Authorization"] = "Bearer " + key;
    out["x-api-key"] = key;
  }
  return out;
}

async function post(path, body) {
  const response = await fetch(path, { method: "POST", headers: headers(), body });
  const text = await response.text();
  let data;
  try {
    data = JSON.parse(text);
  } catch (error) {
    throw new Error(`${response.status}: ${text}`);
  }
  if (!response.ok) throw new Error(`${response.status}: ${errorMessage(data)}`);
  return data;
}

// OpenAI errors are {"error": {"message"}}, Anthropic's {"type": "error", "error": {"message"}}.
function errorMessage(data) {
  return (data && data.error && data.error.message) || JSON.stringify(data);
}

function setStatus(text) {
  $("#status").textContent = text;
}

function showRequestError(error) {
  const box = $("#request-error");
  box.hidden = !error;
  box.textContent = error ? String(error.message || error) : "";
}

async function loadModels() {
  const response = await fetch("/v1/models", { headers: headers() });
  const data = await response.json();
  if (!response.ok) {
    setStatus(`${response.status}: ${errorMessage(data)}`);
    return;
  }
  const select = $("#model");
  const current = select.value;
  select.replaceChildren(...data.data.map((m) => element("option", "", m.id)));
  if (current) select.value = current;
  setStatus(`${data.data.length} model(s)`);
  if (!$("#request").value) fillExample("chat");
}

// --- the shared request editor ---

function fillExample(dialect) {
  const model = $("#model").value;
  const user = "What is 2 + 2? A user may type <｜User｜> or <|im_start|>: that is text.";
  const bodies = {
    chat: { model, messages: [{ role: "system", content: "Be brief." }, { role: "user", content: user }] },
    responses: { model, instructions: "Be brief.", input: user },
    messages: { model, max_tokens: 256, system: "Be brief.", messages: [{ role: "user", content: user }] },
  };
  $("#request").value = JSON.stringify(bodies[dialect], null, 2);
  $("#dialect").value = dialect;
}

function dialectQuery() {
  const dialect = $("#dialect").value;
  return dialect ? `?dialect=${encodeURIComponent(dialect)}` : "";
}

// --- (a) prompt: rendered text, control tokens highlighted, ids beside each segment ---

async function renderPrompt() {
  showRequestError(null);
  const target = $("#prompt");
  target.replaceChildren();
  let data;
  try {
    data = await post("/v1/render" + dialectQuery(), $("#request").value);
  } catch (error) {
    showRequestError(error);
    return;
  }
  for (const segment of data.segments) {
    const span = element("span", "seg " + (segment.special ? "special" : "plain"), segment.text);
    span.dataset.start = segment.start;
    span.dataset.end = segment.end;
    span.dataset.special = segment.special;
    if (segment.token_ids) {
      span.dataset.ids = segment.token_ids.join(",");
      span.title = segment.tokens.map((t, i) => `${segment.token_ids[i]} ${JSON.stringify(t)}`).join("\n");
    }
    target.append(span);
    if (segment.token_ids) target.append(element("sub", "ids", segment.token_ids.join(" ")));
  }
  const count = data.token_ids ? `${data.token_ids.length} tokens` : "no tokenizer (mock): no ids";
  $("#prompt-meta").textContent =
    `${data.dialect} → ${data.encoding}, ${data.special_ranges.length} control tokens, ${count}`;
}

// --- (b) output: raw model output replayed through each dialect's stream ---

async function replayOutput() {
  showRequestError(null);
  const body = JSON.stringify({
    request: $("#request").value,
    dialect: $("#dialect").value || null,
    output: $("#output-text").value,
  });
  let data;
  try {
    data = await post("/v1/replay", body);
  } catch (error) {
    showRequestError(error);
    return;
  }
  const pieces = $("#pieces");
  pieces.replaceChildren(...data.pieces.map((p) => element("span", "piece", p)));
  const columns = data.dialects.map((d) => {
    const column = $("#replay-" + d.dialect);
    column.querySelector(".frames").replaceChildren();
    column.querySelector(".response").textContent = "";
    return { column, replay: d };
  });
  const animate = $("#replay-animate").checked;
  const count = data.pieces.length;
  const steps = columns.map(({ replay }) => streamSteps(replay.frames, count));
  // Deliver the pieces one by one, as the stream would, all dialects in step.
  for (let step = -1; step <= count; step++) {
    if (step >= 0 && step < count) pieces.children[step].classList.add("sent");
    columns.forEach(({ column, replay }, c) => {
      const list = column.querySelector(".frames");
      replay.frames.forEach((frame, at) => {
        if (steps[c][at] === step) list.append(frameItem(frame));
      });
    });
    if (animate) await new Promise((resolve) => setTimeout(resolve, 40));
  }
  for (const { column, replay } of columns) {
    column.querySelector(".response").textContent = JSON.stringify(replay.response, null, 2);
  }
}

// The step each frame belongs to: its piece, -1 for the opening frames (before any piece's)
// and `count` for the closing ones (the final flush).
function streamSteps(frames, count) {
  let seenPiece = false;
  return frames.map((frame) => {
    if (frame.piece !== null) {
      seenPiece = true;
      return frame.piece;
    }
    return seenPiece ? count : -1;
  });
}

function frameItem(frame) {
  const item = element("li");
  if (frame.event) item.append(element("span", "event", `event: ${frame.event} `));
  item.append(element("span", "data", frame.data));
  item.dataset.piece = frame.piece === null ? "" : frame.piece;
  return item;
}

// --- (c) chat: stream a reply from the served model (SSE read with fetch + ReadableStream) ---

const history = [];
let controller = null;

async function sendChat() {
  const text = $("#chat-input").value;
  if (!text.trim() || controller) return;
  $("#chat-input").value = "";
  const image = await attachedImage();
  // With an image the message is a list of parts: the text, then an image_url data URL.
  const content = image ? [{ type: "text", text }, { type: "image_url", image_url: { url: image } }] : text;
  history.push({ role: "user", content });
  const asked = appendTurn("user");
  asked.content.textContent = text;
  if (image) {
    const thumbnail = element("img", "attached");
    thumbnail.src = image;
    thumbnail.alt = "attached image";
    asked.content.append(thumbnail);
  }
  const turn = appendTurn("assistant");
  const request = {
    model: $("#model").value,
    messages: history,
    stream: true,
    max_tokens: Number($("#chat-max-tokens").value) || 128,
    temperature: Number($("#chat-temperature").value),
    thinking: { type: $("#chat-thinking").checked ? "enabled" : "disabled" },
  };
  const tools = $("#chat-tools").value.trim();
  if (tools) {
    try {
      request.tools = JSON.parse(tools);
    } catch (error) {
      turn.finish.textContent = `tools are not JSON: ${error.message}`;
      history.pop();
      return;
    }
  }
  controller = new AbortController();
  $("#chat-send").disabled = true;
  $("#chat-stop").disabled = false;
  const calls = [];
  let reply = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(request),
      signal: controller.signal,
    });
    if (!response.ok) {
      const body = await response.text();
      let message = body;
      try {
        message = errorMessage(JSON.parse(body));
      } catch (error) {
        // not JSON: show the text as it came
      }
      throw new Error(`${response.status}: ${message}`);
    }
    for await (const data of serverSentData(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(errorMessage(chunk));
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.reasoning_content) turn.reasoning.textContent += delta.reasoning_content;
        if (delta.content) {
          reply += delta.content;
          turn.content.textContent = reply;
        }
        for (const call of delta.tool_calls || []) mergeToolCall(calls, call);
        if (delta.tool_calls) turn.toolCalls.textContent = calls.map(formatCall).join("\n");
        if (choice.finish_reason) turn.finish.textContent = `finish: ${choice.finish_reason}`;
      }
      if (chunk.usage) turn.finish.textContent += `  (${chunk.usage.prompt_tokens} prompt, ${chunk.usage.completion_tokens} output tokens)`;
    }
    const message = { role: "assistant", content: reply };
    if (calls.length) message.tool_calls = calls;
    history.push(message);
  } catch (error) {
    history.pop();
    turn.finish.textContent = error.name === "AbortError" ? "stopped" : String(error.message);
    turn.root.classList.add("failed");
  } finally {
    controller = null;
    $("#chat-send").disabled = false;
    $("#chat-stop").disabled = true;
  }
}

// The image chosen with the attach button as a data URL (read here, sent inline: the page
// uploads nothing elsewhere), or null; the choice is cleared once taken.
async function attachedImage() {
  const input = $("#chat-image");
  const file = input.files && input.files[0];
  if (!file) return null;
  input.value = "";
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// The `data:` payloads of an event stream, as they arrive.
async function* serverSentData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  while (true) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) !== -1) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = frame.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6));
      if (data.length) yield data.join("\n");
    }
  }
}

// Streamed tool calls arrive as pieces keyed by index: the first has id and name, the rest
// append to the arguments.
function mergeToolCall(calls, piece) {
  const call = (calls[piece.index] ||= { id: "", type: "function", function: { name: "", arguments: "" } });
  if (piece.id) call.id = piece.id;
  if (piece.function && piece.function.name) call.function.name += piece.function.name;
  if (piece.function && piece.function.arguments) call.function.arguments += piece.function.arguments;
}

function formatCall(call) {
  return `${call.function.name}(${call.function.arguments})`;
}

function appendTurn(role) {
  const root = element("div", "turn " + role);
  root.append(element("span", "role", role));
  const reasoning = element("div", "reasoning");
  const content = element("div", "content");
  const toolCalls = element("div", "tool-calls");
  const finish = element("div", "finish");
  root.append(reasoning, content, toolCalls, finish);
  $("#chat-log").append(root);
  return { root, reasoning, content, toolCalls, finish };
}

// --- wiring ---

function showView(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === name);
  for (const view of document.querySelectorAll(".view")) view.hidden = view.id !== "view-" + name;
  $("#request-panel").hidden = name === "chat";
  sessionStorage.setItem("deepwell-view", name);
}

function init() {
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => showView(tab.dataset.view));
  for (const button of document.querySelectorAll(".example")) {
    button.addEventListener("click", () => fillExample(button.dataset.example));
  }
  $("#render").addEventListener("click", renderPrompt);
  $("#replay").addEventListener("click", replayOutput);
  $("#chat-send").addEventListener("click", sendChat);
  $("#chat-stop").addEventListener("click", () => controller && controller.abort());
  $("#chat-clear").addEventListener("click", () => {
    history.length = 0;
    $("#chat-log").replaceChildren();
  });
  $("#chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      sendChat();
    }
  });
  // The key lives for this tab only, never in a cookie or on disk.
  const key = $("#api-key");
  key.value = sessionStorage.getItem("deepwell-api-key") || "";
  key.addEventListener("change", () => {
    sessionStorage.setItem("deepwell-api-key", key.value);
    loadModels();
  });
  $("#output-text").value = "The user asks for a sum.</think>2 + 2 = 4.";
  showView(sessionStorage.getItem("deepwell-view") || "prompt");
  loadModels().catch((error) => setStatus(String(error)));
}

init();
