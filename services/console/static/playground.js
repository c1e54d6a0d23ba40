// The playground: streams a chat completion and, when the connection drops, resumes from
// the last event id it saw (`GET /v1/runs/{id}/events` with `Last-Event-ID`), so no token
// is lost or shown twice. Every frame of the completion carries an id: the seq of a stored
// event, or `seq.tokens.chars` for tokens sent before they were stored; the server leaves
// out of a resumed stream what that id says the client has. The run id is the answer's
// `x-request-id`.

import { ApiError, call, followRun, json, readSse } from "./api.js";
import { $, fill, h, money } from "./dom.js";

const MAX_RESUMES = 20;
const TERMINAL = new Set(["RUN_STATE_COMPLETED", "RUN_STATE_FAILED", "RUN_STATE_CANCELLED"]);

export class Playground {
  constructor(root, { onBilled }) {
    this.root = root;
    this.onBilled = onBilled;
    this.run = null;
    this.connection = null;
  }

  async models() {
    const answer = await json("/v1/models");
    fill($("#pg-model"), answer.data.map((m) => h("option", { value: m.id }, m.id)));
  }

  // Drops the connection in flight, as a network failure would: the stream resumes.
  drop() {
    if (this.connection) this.connection.abort(new DOMException("dropped", "AbortError"));
  }

  async stop() {
    if (!this.run || !this.run.runId) return;
    this.run.stopped = true;
    this.drop();
    await json(`/v1/runs/${this.run.runId}/cancel`, { method: "POST" }).catch(() => null);
  }

  async start() {
    const body = {
      model: $("#pg-model").value,
      messages: [{ role: "user", content: $("#pg-prompt").value }],
      max_tokens: Number($("#pg-max-tokens").value) || 64,
      temperature: Number($("#pg-temperature").value),
      stream: true,
      ignore_eos: $("#pg-ignore-eos").checked,
    };
    const run = { runId: null, lastId: "0", text: "", ids: [], resumes: [], ended: null };
    this.run = run;
    this.show();
    try {
      await this.stream(run, body);
      while (!run.billed && !run.stopped) await this.resume(run);
    } catch (error) {
      run.error = error instanceof ApiError ? error.message : String(error);
    }
    this.connection = null;
    this.show();
    if (run.billed) this.onBilled(run);
  }

  async stream(run, body) {
    this.connection = new AbortController();
    try {
      const response = await call("/v1/chat/completions", {
        method: "POST",
        body: JSON.stringify(body),
        signal: this.connection.signal,
      });
      if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
      run.runId = response.headers.get("x-request-id");
      await readSse(response, (frame) => this.completionFrame(run, frame));
    } catch (error) {
      if (error instanceof ApiError || !run.runId) throw error;
      this.dropped(run, error);
    }
  }

  completionFrame(run, frame) {
    if (frame.data === "[DONE]") return;
    const chunk = JSON.parse(frame.data);
    if (frame.id !== null) run.lastId = frame.id;
    if (chunk.error) run.ended = chunk.error.code || "failed";
    for (const choice of chunk.choices || []) {
      const text = (choice.delta && choice.delta.content) || "";
      if (text) this.append(run, run.lastId, text);
      if (choice.finish_reason) run.ended = choice.finish_reason;
    }
    this.show();
  }

  async resume(run) {
    if (run.resumes.length >= MAX_RESUMES) throw new Error("gave up resuming the stream");
    if (run.resumes.length > 0 || !run.ended) run.resumes.push(run.lastId);
    this.connection = new AbortController();
    this.show();
    try {
      const onEvent = (event, id) => this.runEvent(run, event, id);
      await followRun(run.runId, run.lastId, onEvent, this.connection.signal);
    } catch (error) {
      if (error instanceof ApiError) throw error;
      this.dropped(run, error);
      await new Promise((done) => setTimeout(done, 250));
    }
  }

  runEvent(run, event, id) {
    run.lastId = id;
    if (event.state === "RUN_STATE_STREAMING" && event.streaming.text) {
      this.append(run, id, event.streaming.text);
    }
    if (TERMINAL.has(event.state)) run.ended = event.state.replace("RUN_STATE_", "").toLowerCase();
    if (event.state === "RUN_STATE_BILLED") run.billed = event.billed;
    this.show();
  }

  append(run, id, text) {
    run.text += text;
    run.ids.push(id);
  }

  dropped(run, error) {
    run.drops = (run.drops || 0) + 1;
    run.lastError = String(error && error.message ? error.message : error);
  }

  show() {
    const run = this.run;
    if (!run) return;
    const output = $("#pg-output");
    output.textContent = run.text;
    output.dataset.ids = run.ids.join(",");
    output.dataset.runId = run.runId || "";
    const status = $("#pg-status");
    status.dataset.state = run.billed ? "billed" : run.error ? "error" : run.ended ? "ended" : "streaming";
    status.dataset.resumes = String(run.resumes.length);
    const parts = [run.runId ? `run ${run.runId}` : "starting…", `last event ${run.lastId}`];
    if (run.resumes.length) parts.push(`resumed from event ${run.resumes.join(", ")}`);
    if (run.ended) parts.push(`ended: ${run.ended}`);
    if (run.billed) parts.push(`billed ${money(Number(run.billed.amount_micros), run.billed.currency)}`);
    if (run.error) parts.push(`error: ${run.error}`);
    status.textContent = parts.join(" · ");
  }
}
