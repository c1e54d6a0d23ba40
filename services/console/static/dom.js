// Small DOM helpers. Text always goes in as text (model output is never markup).

export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function $(selector) {
  return document.querySelector(selector);
}

export function fill(node, ...children) {
  node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined));
}

export function money(micros, currency) {
  return `${(micros / 1e6).toFixed(6)} ${currency || ""}`.trim();
}

export function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? `${(value * 1000).toFixed(1)} ms` : `${value.toFixed(2)} s`;
}

export function clock(iso) {
  if (!iso) return "";
  const t = new Date(iso);
  return `${t.toISOString().slice(11, 23)}Z`;
}

export function stateName(state) {
  return String(state || "").replace("RUN_STATE_", "").toLowerCase();
}

// Calls `job` now and every `ms` until the returned stop() is called.
export function every(ms, job) {
  let timer = null;
  let stopped = false;
  const tick = async () => {
    try {
      await job();
    } catch (error) {
      console.warn(error);
    }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  tick();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
