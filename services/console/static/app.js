// Signs in, then shows the tenant's or the operator's view and keeps it current.

import { ApiError, forget, json, remember, secret } from "./api.js";
import { $, every, fill } from "./dom.js";
import { createKey, revokeKey, showFleet, showHealth, showLatency, showTenants, showTopTenants } from "./operator.js";
import { Playground } from "./playground.js";
import { showRuns, showTimeline } from "./tenant.js";
import { showUsage } from "./usage.js";

const stops = [];
let timeline = null;

async function signIn(event) {
  event.preventDefault();
  const field = $("#secret");
  remember(field.value.trim());
  field.value = "";
  await start();
}

function signOut() {
  forget();
  while (stops.length) stops.pop()();
  closeTimeline();
  location.hash = "";
  show("signin");
}

function show(view) {
  for (const section of document.querySelectorAll("[data-view]")) {
    section.hidden = section.dataset.view !== view;
  }
  $("#signout").hidden = view === "signin";
}

async function start() {
  if (!secret()) return show("signin");
  let session;
  try {
    session = await json("/console/api/session");
  } catch (error) {
    forget();
    show("signin");
    fill($("#signin-error"), error instanceof ApiError ? error.message : String(error));
    return;
  }
  fill($("#signin-error"));
  if (session.role === "operator") return startOperator();
  return startTenant(session);
}

function startTenant(session) {
  show("tenant");
  fill($("#who"), `${session.tenant_name} (${session.tenant_id})`);
  const refreshUsage = () => showUsage($("#usage"));
  const refreshRuns = () => showRuns($("#runs"), openTimeline);
  const onBilled = () => Promise.all([refreshUsage(), refreshRuns()]);
  const playground = new Playground($("#playground"), { onBilled });
  playground.models();
  $("#pg-form").onsubmit = (event) => {
    event.preventDefault();
    playground.start();
  };
  $("#pg-drop").onclick = () => playground.drop();
  $("#pg-stop").onclick = () => playground.stop();
  stops.push(every(2000, refreshRuns));
  stops.push(every(15000, refreshUsage));
  window.onhashchange = route;
  route();
}

function startOperator() {
  show("operator");
  fill($("#who"), "operator");
  const minutes = $("#latency-minutes");
  stops.push(every(3000, () => showFleet($("#fleet"))));
  stops.push(every(3000, () => showLatency($("#latency"), minutes.value)));
  stops.push(every(10000, () => showTopTenants($("#top-tenants"))));
  stops.push(every(10000, () => showHealth($("#health"))));
  stops.push(every(15000, () => showUsage($("#fleet-usage"))));
  stops.push(every(30000, () => showTenants($("#key-tenant"))));
  minutes.onchange = () => showLatency($("#latency"), minutes.value);
  $("#key-create").onclick = () => createKey().catch(showKeyError);
  $("#key-revoke").onclick = () => revokeKey().catch(showKeyError);
}

function showKeyError(error) {
  fill($("#key-result"), error.message);
}

function route() {
  const match = /^#run\/([A-Za-z0-9_-]+)$/.exec(location.hash);
  if (match) openTimeline(match[1]);
  else closeTimeline();
}

function openTimeline(runId) {
  closeTimeline();
  $("#timeline").hidden = false;
  timeline = new AbortController();
  const signal = timeline.signal;
  showTimeline(runId, signal).catch((error) => {
    if (!signal.aborted) fill($("#timeline-title"), `Run ${runId}: ${error.message}`);
  });
}

function closeTimeline() {
  if (timeline) timeline.abort();
  timeline = null;
  $("#timeline").hidden = true;
}

$("#signin-form").onsubmit = signIn;
$("#signout").onclick = signOut;
$("#timeline-close").onclick = () => {
  location.hash = "";
  closeTimeline();
};
start();
