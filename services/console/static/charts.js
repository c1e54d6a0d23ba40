// Bar charts drawn as inline SVG: no charting library, nothing to build.

const NS = "http://www.w3.org/2000/svg";
const WIDTH = 560;
const HEIGHT = 180;
const PAD = { left: 56, right: 8, top: 10, bottom: 28 };

function el(tag, attrs = {}, text) {
  const node = document.createElementNS(NS, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

// bars: [{label, parts: [{value, cls, name}]}] stacked bottom-up; format(v) labels the axis.
export function barChart(title, bars, format = String) {
  const svg = el("svg", {
    viewBox: `0 0 ${WIDTH} ${HEIGHT}`,
    class: "chart",
    role: "img",
    "aria-label": title,
  });
  const total = (bar) => bar.parts.reduce((sum, p) => sum + p.value, 0);
  // The tallest bar fills the plot, however small (a day's spend may be a few micro-units).
  const top = Math.max(0, ...bars.map(total)) || 1;
  const plotW = WIDTH - PAD.left - PAD.right;
  const plotH = HEIGHT - PAD.top - PAD.bottom;
  const slot = plotW / Math.max(1, bars.length);
  svg.append(el("title", {}, title));
  for (const fraction of [0, 0.5, 1]) {
    const y = PAD.top + plotH * (1 - fraction);
    svg.append(el("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: y, y2: y, class: "grid" }));
    svg.append(el("text", { x: PAD.left - 4, y: y + 4, class: "axis end" }, format(top * fraction)));
  }
  bars.forEach((bar, i) => {
    let y = PAD.top + plotH;
    const x = PAD.left + i * slot + slot * 0.15;
    for (const part of bar.parts) {
      const height = (part.value / top) * plotH;
      y -= height;
      const rect = el("rect", { x, y, width: slot * 0.7, height, class: part.cls });
      rect.append(el("title", {}, `${bar.label} ${part.name}: ${format(part.value)}`));
      svg.append(rect);
    }
    if (bars.length <= 16 || i % 2 === 0) {
      const labelX = x + slot * 0.35;
      svg.append(el("text", { x: labelX, y: HEIGHT - 10, class: "axis mid" }, bar.label));
    }
  });
  return svg;
}

export function compact(value) {
  if (value >= 1e6) return `${(value / 1e6).toFixed(1)}M`;
  if (value >= 1e3) return `${(value / 1e3).toFixed(1)}k`;
  return String(Math.round(value * 100) / 100);
}
