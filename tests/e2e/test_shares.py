"""A tenant's share of the worker through the four processes: a light tenant's
interactive run that does not fit beside another tenant's long run has that run
suspended, ends first, and the suspended run's client still gets each token once."""

from __future__ import annotations

import threading
import time
import urllib.request

from tests.e2e.conftest import NUM_KV_BLOCKS, Stack
from tollgate import RunEvent

# With its prompt, most of the worker's blocks; what is left cannot hold the light run.
FLOOD_TOKENS = 2000
LIGHT_TOKENS = 600


def test_a_light_run_suspends_a_long_run_of_another_tenant_which_loses_no_token(
    stack: Stack,
) -> None:
    assert (FLOOD_TOKENS + LIGHT_TOKENS) // 16 > NUM_KV_BLOCKS > FLOOD_TOKENS // 16
    flood, light = stack.tenant_client("share-flood"), stack.tenant_client("share-light")
    flood_events: list[RunEvent] = []

    def read_flood() -> None:
        for event in flood.generate(
            "a long story",
            model="tiny",
            max_tokens=FLOOD_TOKENS,
            temperature=0,
            ignore_eos=True,
            priority="batch",
        ):
            flood_events.append(event)

    reader = threading.Thread(target=read_flood)
    reader.start()
    while sum(e.kind == "streaming" for e in flood_events) < 2:
        time.sleep(0.01)
    events = list(
        light.generate(
            "quick", model="tiny", max_tokens=LIGHT_TOKENS, temperature=0, ignore_eos=True
        )
    )
    reader.join(timeout=120)
    assert [e.kind for e in events][-2:] == ["completed", "billed"]
    [completed] = [e for e in flood_events if e.kind == "completed"]
    # It did not wait for the flood's run to end. The stored events' times, not when the
    # clients read them: the light run's billing can land after the flood's last tokens.
    light_completed = events[-2]
    assert light_completed.time is not None and completed.time is not None
    assert light_completed.time <= completed.time
    tokens = [t for e in flood_events if e.kind == "streaming" for t in e.token_ids]
    usage = completed.usage
    assert usage is not None and len(tokens) == usage.output_tokens == FLOOD_TOKENS
    url = f"http://127.0.0.1:{stack.metrics['worker']}/metrics"
    scraped = urllib.request.urlopen(url).read().decode()
    assert 'tollgate_num_preemptions_total{model_name="tiny",reason="share"}' in scraped
