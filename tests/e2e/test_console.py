"""The web console in headless Chromium (Debian's, driven by Playwright) against a running
stack: a tenant signs in, watches a chat stream that loses its connection and resumes
with no token lost or repeated, and sees the usage chart take in the billed run; the
operator sees the fleet. Screenshots go to TOLLGATE_E2E_LOGS/console, else the test's
temporary folder."""

from __future__ import annotations

import http.client
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from services.core.live import parse_position
from tests.e2e.conftest import ADMIN_TOKEN, Stack

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As a root process on a machine with no outside network: no sandbox, nothing phoning home.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Cuts the first chat completion's stream after its third event, as a dropped connection
# would: the frames up to there reach the page, then its read fails and the request is
# aborted, so the server sees the client go.
BREAK_FIRST_STREAM = """
(() => {
  const realFetch = window.fetch.bind(window);
  window.tollgateBreaks = 0;
  window.fetch = async (input, init = {}) => {
    const url = typeof input === "string" ? input : input.url;
    if (!url.endsWith("/v1/chat/completions") || window.tollgateBreaks > 0) {
      return realFetch(input, init);
    }
    window.tollgateBreaks += 1;
    const cut = new AbortController();
    const response = await realFetch(input, { ...init, signal: cut.signal });
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    const encoder = new TextEncoder();
    let buffer = "";
    let numFrames = 0;
    const body = new ReadableStream({
      async pull(controller) {
        const { value, done } = await reader.read();
        if (done) return controller.close();
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\\n\\n")) >= 0) {
          const frame = buffer.slice(0, end + 2);
          buffer = buffer.slice(end + 2);
          controller.enqueue(encoder.encode(frame));
          if (frame.startsWith("id:") && ++numFrames === 3) {
            cut.abort();
            controller.error(new TypeError("network connection lost"));
            return;
          }
        }
      },
    });
    return new Response(body, { status: response.status, headers: response.headers });
  };
})();
"""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package")
    if not os.path.exists(CHROMIUM):
        pytest.skip("no Chromium: install Debian's chromium package (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        yield browser
        browser.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    kept = os.environ.get("TOLLGATE_E2E_LOGS")
    folder = Path(kept) / "console" if kept else tmp_path / "console"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def run_events(stack: Stack, key: str, run_id: str) -> list[dict[str, Any]]:
    """Every event of the run, read from `GET /v1/runs/{id}/events` until `billed`."""
    conn = http.client.HTTPConnection(urlsplit(stack.http).netloc, timeout=60)
    conn.request("GET", f"/v1/runs/{run_id}/events", headers={"authorization": f"Bearer {key}"})
    text = conn.getresponse().read().decode()
    conn.close()
    return [
        json.loads(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


def sign_in(page: Any, stack: Stack, secret: str) -> None:
    page.goto(f"{stack.http}/console")
    page.fill("#secret", secret)
    page.click("#signin-form button[type=submit]")


def test_a_tenant_watches_a_stream_resume_and_its_usage_grow(
    stack: Stack, browser: Any, shots: Path
) -> None:
    key = stack.tenant_key("console")
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.add_init_script(BREAK_FIRST_STREAM)
    sign_in(page, stack, key)
    usage = page.locator("#usage")
    usage.locator("svg").first.wait_for()
    assert usage.get_attribute("data-total-tokens") == "0"
    assert key not in page.url
    assert page.evaluate("Object.keys(localStorage).length") == 0
    page.screenshot(path=shots / "1-signed-in.png", full_page=True)

    page.fill("#pg-max-tokens", "48")
    page.check("#pg-ignore-eos")
    page.click("#pg-send")
    page.wait_for_selector("#pg-status[data-state=billed]", timeout=90_000)
    page.screenshot(path=shots / "2-resumed-and-billed.png", full_page=True)

    output = page.locator("#pg-output")
    run_id = output.get_attribute("data-run-id")
    assert run_id and run_id.startswith("run_")
    assert page.evaluate("window.tollgateBreaks") == 1
    assert int(page.locator("#pg-status").get_attribute("data-resumes") or 0) >= 1
    events = run_events(stack, key, run_id)
    streamed = [e for e in events if e["state"] == "RUN_STATE_STREAMING"]
    assert len(streamed) >= 3 and events[-1]["state"] == "RUN_STATE_BILLED"
    # Exactly the run's text, each token's piece once, in order: the ids of the pieces
    # shown (stored seqs, and positions of tokens sent before they were stored) go up.
    assert output.text_content() == "".join(e["streaming"]["text"] for e in streamed)
    shown = [parse_position(i) for i in (output.get_attribute("data-ids") or "").split(",")]
    assert all(p is not None for p in shown)
    assert shown == sorted(shown, key=lambda p: (p.seq, p.tokens))  # type: ignore[union-attr]

    page.wait_for_function(
        "document.querySelector('#usage').dataset.totalTokens !== '0'", timeout=30_000
    )
    assert int(usage.get_attribute("data-total-tokens") or 0) >= 48
    assert usage.get_attribute("data-num-runs") == "1"

    page.locator(f"#runs tr[data-run-id='{run_id}'] a").click()
    page.wait_for_selector("#timeline-events tr[data-kind=billed]", timeout=30_000)
    seqs = page.locator("#timeline-events tr").evaluate_all(
        "rows => rows.map(r => Number(r.dataset.seq))"
    )
    assert seqs == [e["seq"] for e in events]
    assert page.locator("#timeline-events").get_by_text("first token").count() == 1
    page.screenshot(path=shots / "3-timeline.png", full_page=True)
    page.close()


def test_the_operator_sees_the_fleet_and_the_figures(
    stack: Stack, browser: Any, shots: Path
) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 1100})
    sign_in(page, stack, ADMIN_TOKEN)
    page.wait_for_selector("#fleet tr[data-worker-id]", timeout=30_000)
    page.wait_for_selector("#latency [data-figure=ttft-p50]")
    page.wait_for_selector("#health [data-figure=reconciliation]")
    page.wait_for_selector("#fleet-usage svg")
    assert page.locator("#fleet [data-figure=num-workers] .value").text_content() == "1"
    page.select_option("#key-tenant", index=0)
    page.click("#key-create")
    assert (page.locator("#new-secret").text_content() or "").startswith("tg_")
    page.screenshot(path=shots / "4-operator.png", full_page=True)
    page.close()
