// Usage and spend per day (the ledger's GetUsage, day by day), as two bar charts.

import { json } from "./api.js";
import { barChart, compact } from "./charts.js";
import { fill, h, money } from "./dom.js";

export async function showUsage(container, days = 14) {
  const usage = await json(`/console/api/usage?days=${days}`);
  const label = (day) => day.day.slice(5);
  const q = (day, type) => day.quantities[type] || 0;
  const tokens = usage.days.map((day) => ({
    label: label(day),
    parts: [
      { value: q(day, "input_tokens"), cls: "input", name: "input tokens" },
      { value: q(day, "cached_input_tokens"), cls: "cached", name: "cached input tokens" },
      { value: q(day, "output_tokens"), cls: "output", name: "output tokens" },
    ],
  }));
  const spend = usage.days.map((day) => ({
    label: label(day),
    parts: [{ value: day.amount_micros / 1e6, cls: "spend", name: "spend" }],
  }));
  const totalTokens = usage.days.reduce(
    (sum, day) =>
      sum + q(day, "input_tokens") + q(day, "cached_input_tokens") + q(day, "output_tokens"),
    0,
  );
  const totalMicros = usage.days.reduce((sum, day) => sum + day.amount_micros, 0);
  const totalRuns = usage.days.reduce((sum, day) => sum + day.num_runs, 0);
  container.dataset.totalTokens = String(totalTokens);
  container.dataset.totalMicros = String(totalMicros);
  container.dataset.numRuns = String(totalRuns);
  fill(
    container,
    h(
      "p",
      { class: "summary" },
      `${days} days: ${totalRuns} runs billed, ${totalTokens} tokens, `,
      h("strong", {}, money(totalMicros, usage.currency)),
    ),
    h("div", { class: "legend" }, h("span", { class: "input" }, "input"),
      h("span", { class: "cached" }, "cached input"),
      h("span", { class: "output" }, "output"),),
    barChart("tokens per day", tokens, compact),
    barChart(`spend per day (${usage.currency})`, spend, (v) => (v ? v.toPrecision(2) : "0")),
  );
}
