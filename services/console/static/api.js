// The console's calls to its server: the secret lives in this tab's sessionStorage only,
// goes out as `authorization: Bearer`, and never into a URL.

const SECRET = "tollgate.console.secret";

export function secret() {
  return sessionStorage.getItem(SECRET) || "";
}

export function remember(value) {
  sessionStorage.setItem(SECRET, value);
}

export function forget() {
  sessionStorage.removeItem(SECRET);
}

export class ApiError extends Error {
  constructor(status, body) {
    super((body && body.error && body.error.message) || `HTTP ${status}`);
    this.status = status;
    this.body = body;
  }
}

// fetch() with the secret; `headers` and the rest as fetch takes them.
export function call(path, options = {}) {
  const headers = { ...(options.headers || {}), authorization: `Bearer ${secret()}` };
  if (options.body !== undefined && !headers["content-type"]) {
    headers["content-type"] = "application/json";
  }
  return fetch(path, { ...options, headers, cache: "no-store", referrerPolicy: "no-referrer" });
}

// The JSON answer of a call; raises ApiError with the server's error body otherwise.
export async function json(path, options = {}) {
  const response = await call(path, options);
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new ApiError(response.status, body);
  return body;
}

// Reads a server-sent-event stream, calling onFrame({id, data}) for each event. Returns
// when the stream ends; rejects when the connection breaks.
export async function readSse(response, onFrame) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = parseFrame(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
      if (frame.data !== null) onFrame(frame);
    }
  }
}

function parseFrame(block) {
  const frame = { id: null, data: null };
  for (const line of block.split("\n")) {
    const colon = line.indexOf(":");
    if (colon <= 0) continue;
    const name = line.slice(0, colon);
    const value = line.slice(colon + 1).replace(/^ /, "");
    if (name === "id") frame.id = value;
    if (name === "data") frame.data = frame.data === null ? value : `${frame.data}\n${value}`;
  }
  return frame;
}

// The run's events after `afterSeq`, until `billed` (or `signal` aborts): onEvent(event).
export async function followRun(runId, afterId, onEvent, signal) {
  const response = await call(`/v1/runs/${encodeURIComponent(runId)}/events`, {
    headers: { "last-event-id": String(afterId) },
    signal,
  });
  if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
  await readSse(response, (frame) => onEvent(JSON.parse(frame.data), frame.id));
}
