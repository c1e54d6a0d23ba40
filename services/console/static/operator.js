// The operator's view (admin token): fleet, latency, spend, relay, reconciliation, keys.

import { json } from "./api.js";
import { $, fill, h, money, seconds } from "./dom.js";

export async function showFleet(container) {
  const fleet = await json("/console/api/fleet");
  if (!fleet.available) {
    fill(container, h("p", { class: "warn" }, "The scheduler does not answer."));
    return;
  }
  const workers = fleet.workers.map((w) => {
    const used = w.kv_usage === null ? null : Math.round(w.kv_usage * 100);
    const state = !w.alive ? "lost" : w.draining ? "draining" : w.suspect ? "suspect" : "live";
    return h(
      "tr",
      { "data-worker-id": w.worker_id },
      h("td", {}, w.worker_id),
      h("td", {}, w.model || "any"),
      h("td", {}, h("span", { class: `badge ${state}` }, state)),
      h("td", {}, meter(used), ` ${used === null ? "–" : `${used}%`} of ${w.num_total_blocks} blocks`),
      h("td", { class: "num" }, w.num_running),
      h("td", { class: "shares" }, w.tenants.map((t) => share(t, w.num_total_blocks))),
    );
  });
  fill(
    container,
    h(
      "div",
      { class: "cards" },
      card("interactive queued", fleet.queues.interactive, "queue-interactive"),
      card("batch queued", fleet.queues.batch, "queue-batch"),
      card("running", fleet.num_running, "num-running"),
      card("workers", fleet.num_workers, "num-workers"),
    ),
    h(
      "table",
      {},
      h("thead", {}, h("tr", {}, ["worker", "model", "state", "KV cache", "running", "tenants' shares"].map((c) => h("th", {}, c)))),
      h("tbody", {}, workers),
    ),
  );
}

// One tenant's part of a worker's KV blocks, and its runs suspended for another's share.
function share(tenant, numTotalBlocks) {
  const part = numTotalBlocks > 0 ? `${Math.round((100 * tenant.num_kv_blocks) / numTotalBlocks)}%` : "–";
  const suspended = tenant.num_suspended_runs ? `, ${tenant.num_suspended_runs} suspended` : "";
  return h(
    "div",
    { "data-tenant-id": tenant.tenant_id, title: tenant.tenant_id },
    `${tenant.tenant_id.slice(0, 8)} ${part} (${tenant.num_runs} runs${suspended})`,
  );
}

export async function showLatency(container, minutes) {
  const l = await json(`/console/api/latency?minutes=${minutes}`);
  fill(
    container,
    h(
      "div",
      { class: "cards" },
      card("TTFT p50", seconds(l.ttft_p50), "ttft-p50"),
      card("TTFT p99", seconds(l.ttft_p99), "ttft-p99"),
      card("ITL p50", seconds(l.itl_p50), "itl-p50"),
      card("ITL p99", seconds(l.itl_p99), "itl-p99"),
      card("tokens/s", l.tokens_per_second.toFixed(1), "tokens-per-second"),
      card("runs", l.num_runs, "latency-runs"),
    ),
  );
}

export async function showTopTenants(container) {
  const top = await json("/console/api/top-tenants?hours=24&limit=10");
  const rows = top.tenants.map((t) =>
    h(
      "tr",
      {},
      h("td", {}, t.name || t.tenant_id),
      h("td", { class: "num" }, t.num_tokens),
      h("td", { class: "num" }, money(t.amount_micros, top.currency)),
    ),
  );
  fill(
    container,
    rows.length
      ? h("table", {}, h("thead", {}, h("tr", {}, ["tenant", "tokens", "spend"].map((c) => h("th", {}, c)))), h("tbody", {}, rows))
      : h("p", { class: "muted" }, "Nothing billed in the last 24 hours."),
  );
}

export async function showHealth(container) {
  const [relay, report] = await Promise.all([
    json("/console/api/relay"),
    json("/console/api/reconciliation"),
  ]);
  const broken = Object.entries(report.broken).map(([name, b]) =>
    h("li", {}, `${name}: ${b.num_runs} runs (${b.run_ids.slice(0, 3).join(", ")}${b.num_runs > 3 ? ", …" : ""})`),
  );
  fill(
    container,
    h(
      "div",
      { class: "cards" },
      card("relay lag", seconds(relay.oldest_age_seconds), "relay-lag"),
      card("unpublished events", relay.num_unpublished, "relay-unpublished"),
      card("reconciliation", report.ok ? "ok" : "broken", "reconciliation", report.ok ? "ok" : "bad"),
    ),
    broken.length ? h("ul", { class: "warn" }, broken) : null,
  );
}

export async function showTenants(select) {
  const answer = await json("/console/api/tenants");
  const chosen = select.value;
  fill(select, answer.tenants.map((t) => h("option", { value: t.tenant_id }, `${t.name} (${t.tenant_id})`)));
  if (chosen) select.value = chosen;
}

export async function createKey() {
  const tenantId = $("#key-tenant").value;
  const key = await json(`/console/api/tenants/${encodeURIComponent(tenantId)}/keys`, { method: "POST" });
  fill(
    $("#key-result"),
    h("p", {}, `Key ${key.key_id} for ${key.tenant_id}. Copy it now: it is shown once.`),
    h("code", { id: "new-secret" }, key.secret),
  );
}

export async function revokeKey() {
  const keyId = $("#revoke-key-id").value.trim();
  const key = await json(`/console/api/keys/${encodeURIComponent(keyId)}/revoke`, { method: "POST" });
  fill($("#key-result"), h("p", {}, `Key ${key.key_id} of ${key.tenant_id} is revoked.`));
}

function card(label, value, id, cls = "") {
  return h("div", { class: `card ${cls}`, "data-figure": id }, h("span", { class: "label" }, label), h("span", { class: "value" }, value));
}

function meter(percent) {
  // Through the CSSOM: the page's policy allows no inline style attribute.
  const fillBar = h("span");
  fillBar.style.width = `${percent || 0}%`;
  return h("span", { class: "meter" }, fillBar);
}
