// The tenant's view: its runs with their state kept current, and one run's timeline.

import { followRun, json } from "./api.js";
import { $, clock, fill, h, stateName } from "./dom.js";

export async function showRuns(container, onOpen) {
  const answer = await json("/console/api/runs?page_size=25");
  const rows = answer.runs.map((run) =>
    h(
      "tr",
      { "data-run-id": run.run_id, "data-state": stateName(run.state) },
      h("td", {}, h("a", { href: `#run/${run.run_id}`, onclick: () => onOpen(run.run_id) }, run.run_id)),
      h("td", {}, run.model),
      h("td", {}, h("span", { class: `badge ${stateName(run.state)}` }, stateName(run.state))),
      h("td", { class: "num" }, run.usage.prompt_tokens || 0),
      h("td", { class: "num" }, run.usage.output_tokens || 0),
      h("td", { class: "num" }, run.last_seq),
      h("td", {}, clock(run.create_time)),
    ),
  );
  const head = ["run", "model", "state", "prompt", "output", "events", "created"];
  fill(
    container,
    rows.length
      ? h("table", {}, h("thead", {}, h("tr", {}, head.map((c) => h("th", {}, c)))), h("tbody", {}, rows))
      : h("p", { class: "muted" }, "No runs yet: start one in the playground."),
  );
}

// Streams the run's events into the timeline until `billed`; abort `signal` to stop.
export async function showTimeline(runId, signal) {
  const list = $("#timeline-events");
  fill($("#timeline-title"), `Run ${runId}`);
  fill(list);
  let queuedAt = null;
  let sawToken = false;
  await followRun(
    runId,
    0,
    (event) => {
      const at = new Date(event.time).getTime();
      if (queuedAt === null) queuedAt = at;
      let label = stateName(event.state);
      if (label === "streaming" && !sawToken) {
        label = "first token";
        sawToken = true;
      }
      list.append(
        h(
          "tr",
          { "data-seq": event.seq, "data-kind": stateName(event.state) },
          h("td", { class: "num" }, event.seq),
          h("td", {}, h("span", { class: `badge ${stateName(event.state)}` }, label)),
          h("td", {}, clock(event.time)),
          h("td", { class: "num" }, `+${at - queuedAt} ms`),
          h("td", { class: "detail" }, detail(event)),
        ),
      );
    },
    signal,
  );
}

function detail(event) {
  const kind = stateName(event.state);
  const payload = event[kind] || {};
  if (kind === "streaming") return JSON.stringify(payload.text || "");
  if (kind === "completed") return `${payload.finish_reason} · ${tokens(payload.usage)}`;
  if (kind === "failed") return `${payload.code}: ${payload.message || ""} · ${tokens(payload.usage)}`;
  if (kind === "cancelled") return `${payload.reason || ""} · ${tokens(payload.usage)}`;
  if (kind === "billed") return `${(Number(payload.amount_micros) / 1e6).toFixed(6)} ${payload.currency || ""}`;
  if (kind === "queued") return `${payload.model || ""} ${payload.priority || ""}`.trim();
  if (kind === "prefill") return payload.worker_id ? `on ${payload.worker_id}` : "";
  return "";
}

function tokens(usage) {
  if (!usage) return "";
  return `${usage.prompt_tokens || 0} prompt, ${usage.output_tokens || 0} output tokens`;
}
