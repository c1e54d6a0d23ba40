"""The client commands of `tollgate` against the fake server: parsing, output, exit status."""

import argparse
import asyncio
import io
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from services.core.errors import FieldViolation, InvalidArgument
from tests.tollgate.fake_gateway import FakeServer, script
from tollgate.cli import main
from tollgate.commands.admin_keys import moment, seconds
from tollgate.commands.connection import resolve
from tollgate.commands.output import money

API_KEY = "tg_live_secret_key"
ADMIN_TOKEN = "admin_secret_token"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("GATEWAY", "API_KEY", "LEDGER", "ADMIN_TOKEN", "KAFKA_BOOTSTRAP"):
        monkeypatch.delenv(f"TOLLGATE_{name}", raising=False)
    # No stack file of a developer's own is read by accident.
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def stack(fake: FakeServer, tmp_path: Path) -> Path:
    path = tmp_path / "stack.json"
    data = {
        "gateway": fake.address,
        "admin_token": ADMIN_TOKEN,
        "api_key": API_KEY,
        "database_url": "postgresql+psycopg://x",
        "kafka_bootstrap": "127.0.0.1:1",
        "model": "tiny-from-stack",
        "services": {"ledger": {"pid": 1, "address": fake.address}},
    }
    path.write_text(json.dumps(data))
    return path


async def tollgate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = await asyncio.to_thread(main, list(argv))
    except SystemExit as exit_:  # argparse's answer to a bad command line
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def stack_args(stack: Path) -> Sequence[str]:
    return ("--stack", str(stack))


async def test_generate_streams_text_with_the_stack_settings(
    fake: FakeServer, stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await tollgate(
        capsys, "generate", "Hi there", *stack_args(stack), "--max-tokens", "5",
        "--temperature", "0", "--stop", "x", "--stop", "y", "--priority", "batch",
    )  # fmt: skip
    assert (code, out, err) == (0, "Hello, world\n", "")
    [(_, request, metadata)] = fake.gateway.calls
    assert metadata["authorization"] == f"Bearer {API_KEY}"
    assert (request.model, request.prompt) == ("tiny-from-stack", "Hi there")
    assert request.sampling.max_tokens == 5 and request.sampling.HasField("temperature")
    assert list(request.sampling.stop) == ["x", "y"]
    assert request.priority == 2 and request.until_terminal


async def test_generate_sends_penalties_and_biases(
    fake: FakeServer, stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = await tollgate(
        capsys, "generate", "Hi", *stack_args(stack), "--frequency-penalty", "0.5",
        "--presence-penalty", "-0.5", "--repetition-penalty", "1.2", "--min-p", "0.1",
        "--logit-bias", "7=-100", "--logit-bias", "3=2.5",
    )  # fmt: skip
    assert (code, err) == (0, "")
    [(_, request, _)] = fake.gateway.calls
    sampling = request.sampling
    assert (sampling.frequency_penalty, sampling.presence_penalty) == (0.5, -0.5)
    assert sampling.repetition_penalty == pytest.approx(1.2) and sampling.min_p == pytest.approx(
        0.1
    )
    assert dict(sampling.logit_bias) == {7: -100.0, 3: 2.5}
    code, _, err = await tollgate(capsys, "generate", "Hi", *stack_args(stack), "--logit-bias", "7")
    assert code == 2 and "TOKEN=BIAS" in err


async def test_generate_sends_a_schema_tools_and_a_tool_choice(
    fake: FakeServer, stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": schema}}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "tools.json").write_text(json.dumps([tool]))
    code, _, err = await tollgate(
        capsys, "generate", "Hi", *stack_args(stack), "--json-schema", "schema.json",
        "--tools", "tools.json", "--tool-choice", "get_weather", "--no-parallel-tool-calls",
    )  # fmt: skip
    assert (code, err) == (0, "")
    code, _, err = await tollgate(
        capsys, "generate", "Hi", *stack_args(stack), "--json-object", "--tools", "tools.json",
        "--tool-choice", "none",
    )  # fmt: skip
    assert (code, err) == (0, "")
    first, second = (request.sampling for _, request, _ in fake.gateway.calls)
    assert first.response_format.type == "json_schema"
    assert json.loads(first.response_format.json_schema) == schema
    assert [(t.name, json.loads(t.parameters)) for t in first.tools] == [("get_weather", schema)]
    assert (first.tool_choice.mode, first.tool_choice.function) == ("function", "get_weather")
    assert first.HasField("parallel_tool_calls") and not first.parallel_tool_calls
    assert second.response_format.type == "json_object" and second.tool_choice.mode == "none"
    assert not second.HasField("parallel_tool_calls")


async def test_generate_reads_the_schema_from_stdin(
    fake: FakeServer,
    stack: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"type": "object"}'))
    code, _, _ = await tollgate(capsys, "generate", "Hi", *stack_args(stack), "--json-schema", "-")
    assert code == 0
    [(_, request, _)] = fake.gateway.calls
    assert json.loads(request.sampling.response_format.json_schema) == {"type": "object"}


@pytest.mark.parametrize(
    ("flags", "files", "error"),
    [
        (("--json-schema", "none.json"), {}, "error: cannot read --json-schema none.json: "),
        (("--json-schema", "s.json"), {"s.json": "{type"}, "error: --json-schema s.json is not JSON: "),
        (("--json-schema", "s.json"), {"s.json": "[1]"}, "error: --json-schema s.json is not a JSON schema"),
        (("--tools", "t.json"), {"t.json": "{}"}, "error: --tools t.json is not a JSON list of tools"),
        (("--tools", "t.json"), {"t.json": '[{"type": "x"}]'}, "error: tools[0]: must be "),
        (("--json-object", "--json-schema", "s.json"), {"s.json": "{}"}, "not allowed with argument"),
    ],
)  # fmt: skip
async def test_generate_refuses_a_bad_schema_or_tools_file(
    fake: FakeServer,
    stack: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: Sequence[str],
    files: dict[str, str],
    error: str,
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    code, out, err = await tollgate(capsys, "generate", "Hi", *stack_args(stack), *flags)
    assert (code, out) == (2, "")
    assert error in err.splitlines()[-1]
    assert fake.gateway.calls == []


async def test_generate_logprobs_as_a_table_on_stderr_or_in_the_json_events(
    fake: FakeServer, stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.gateway.pieces = ("Hel", "lo")
    code, out, err = await tollgate(capsys, "generate", "Hi", *stack_args(stack), "--logprobs", "2")
    assert (code, out) == (0, "Hello\n")
    assert err.splitlines() == [
        "TOKEN_ID  LOGPROB  TOP",
        "10        -0.5000  10:-0.5000 11:-1.0000",
        "11        -0.5000  11:-0.5000 12:-1.0000",
    ]
    [(_, request, _)] = fake.gateway.calls
    assert (request.sampling.logprobs, request.sampling.top_logprobs) == (True, 2)
    code, out, err = await tollgate(
        capsys, "generate", "Hi", *stack_args(stack), "--logprobs", "0", "--json"
    )
    assert (code, err) == (0, "")
    streaming = [e for e in map(json.loads, out.splitlines()) if e["kind"] == "streaming"]
    assert [e["logprobs"] for e in streaming] == [
        [{"token_id": 10, "logprob": -0.5, "top": []}],
        [{"token_id": 11, "logprob": -0.5, "top": []}],
    ]


async def test_generate_sends_chat_turns_in_command_line_order(
    fake: FakeServer, stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await tollgate(
        capsys, "generate", "--system", "Be brief.", "--user", "Hi", "--assistant", "Hello!",
        "--user", "Capital of France?", *stack_args(stack),
    )  # fmt: skip
    assert (code, out, err) == (0, "Hello, world\n", "")
    [(_, request, _)] = fake.gateway.calls
    assert request.prompt == ""
    assert turns(request) == [
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "Hello!"),
        ("user", "Capital of France?"),
    ]


async def test_generate_takes_a_prompt_or_turns_not_both(
    fake: FakeServer, stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await tollgate(capsys, "generate", "Hi", "--user", "Hi", *stack_args(stack))
    assert (code, out) == (2, "")
    assert err == "error: give a prompt or --system/--user/--assistant turns, not both\n"
    code, _, err = await tollgate(capsys, "generate", *stack_args(stack))
    assert code == 2 and "--user" in err
    assert fake.gateway.calls == []


def turns(request: Any) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in request.messages]


async def chat(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, stdin: str, *argv: str
) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    return await tollgate(capsys, "chat", *argv)


async def test_chat_sends_the_whole_conversation_each_turn(
    fake: FakeServer,
    stack: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, out, err = await chat(capsys, monkeypatch, "Hi\nMore\n", *stack_args(stack))
    assert (code, out, err) == (0, "Hello, world\nHello, world\n", "")
    first, second = (request for _, request, _ in fake.gateway.calls)
    assert turns(first) == [("user", "Hi")] and first.prompt == ""
    assert turns(second) == [("user", "Hi"), ("assistant", "Hello, world"), ("user", "More")]
    assert first.model == "tiny-from-stack" and first.until_terminal


async def test_chat_ends_at_exit_and_keeps_the_system_message_first(
    fake: FakeServer,
    stack: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ("--system", "Be brief.", "--max-tokens", "7", *stack_args(stack))
    code, out, _ = await chat(capsys, monkeypatch, "Hi\n/exit\nNot sent\n", *argv)
    assert (code, out) == (0, "Hello, world\n")
    [(_, request, _)] = fake.gateway.calls
    assert turns(request) == [("system", "Be brief."), ("user", "Hi")]
    assert request.sampling.max_tokens == 7


async def test_chat_reports_a_gateway_error_and_goes_on(
    fake: FakeServer,
    stack: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake.gateway.generate_error = InvalidArgument([FieldViolation("model", "unknown")])
    code, out, err = await chat(capsys, monkeypatch, "Hi\nAgain\n", *stack_args(stack))
    assert (code, out) == (0, "")
    assert err == "error: INVALID_ARGUMENT: model: unknown\n" * 2
    # A turn without a reply is left out of the conversation.
    assert [turns(request) for _, request, _ in fake.gateway.calls] == [
        [("user", "Hi")],
        [("user", "Again")],
    ]


class InterruptedOnce(io.TextIOBase):
    """stdout that raises KeyboardInterrupt at the first streamed text, as Ctrl-C would."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.interrupted = inner, False

    def write(self, text: str) -> int:
        if text and text != "\n" and not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return int(self.inner.write(text))

    def flush(self) -> None:
        self.inner.flush()


async def test_ctrl_c_during_a_reply_cancels_that_run_and_the_chat_goes_on(
    fake: FakeServer,
    stack: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "stdout", InterruptedOnce(sys.stdout))
    code, out, _ = await chat(capsys, monkeypatch, "Hi\nAgain\n", *stack_args(stack))
    assert (code, out) == (0, "\nHello, world\n")
    methods = [method for method, _, _ in fake.gateway.calls]
    assert methods == ["Generate", "CancelRun", "Generate"]
    first_run_id = next(iter(fake.gateway.runs))
    assert fake.gateway.calls[1][1].run_id == first_run_id
    assert turns(fake.gateway.calls[2][1]) == [("user", "Again")]


async def test_generate_json_prints_one_object_per_event_until_billed(
    fake: FakeServer, stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = await tollgate(capsys, "generate", "Hi", *stack_args(stack), "--json")
    assert code == 0
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["seq"] for e in events] == list(range(1, 10))
    assert events[0]["kind"] == "queued" and events[0]["model"] == "tiny-from-stack"
    assert events[2] == {**events[2], "kind": "streaming", "text": "Hel", "token_ids": [10]}
    assert "text" not in events[0]
    assert events[-1]["kind"] == "billed" and events[-1]["amount_micros"] == 1234


async def test_an_invalid_argument_is_one_line_on_stderr(
    fake: FakeServer, stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.gateway.generate_error = InvalidArgument(
        [FieldViolation("sampling.max_tokens", "must be > 0")]
    )
    code, out, err = await tollgate(
        capsys, "generate", "Hi", *stack_args(stack), "--max-tokens", "0"
    )
    assert code == 1 and out == ""
    assert err == "error: INVALID_ARGUMENT: sampling.max_tokens: must be > 0\n"


async def test_a_failed_run_exits_non_zero(
    fake: FakeServer, stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.gateway.end = "failed"
    code, out, err = await tollgate(capsys, "generate", "Hi", *stack_args(stack))
    assert code == 1 and out == "Hello, world\n"
    assert err.startswith("error: WORKER_LOST: run ") and err.count("\n") == 1


async def test_missing_configuration_is_explained(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = await tollgate(capsys, "generate", "Hi", "--model", "tiny")
    assert code == 2
    assert err.startswith("error: no gateway address: pass --gateway, set TOLLGATE_GATEWAY")


async def test_flags_beat_env_which_beats_the_stack(
    stack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tollgate.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["runs", "list", "--stack", str(stack)])
    assert resolve(args, {}).api_key == API_KEY
    assert resolve(args, {}).ledger is not None
    env = {"TOLLGATE_API_KEY": "from-env", "TOLLGATE_LEDGER": "ledger:1"}
    assert (resolve(args, env).api_key, resolve(args, env).ledger) == ("from-env", "ledger:1")
    args = parser.parse_args(["runs", "list", "--stack", str(stack), "--api-key", "from-flag"])
    assert resolve(args, env).api_key == "from-flag"
    assert "from-flag" not in repr(resolve(args, env))


async def test_runs_commands(
    fake: FakeServer, stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await tollgate(capsys, "generate", "Hi", *stack_args(stack))
    [run_id] = fake.gateway.runs
    code, out, _ = await tollgate(capsys, "runs", "get", run_id, *stack_args(stack))
    assert code == 0 and "run_id:" in out and "state:" in out and "billed" in out
    code, out, _ = await tollgate(capsys, "runs", "get", run_id, "--json", *stack_args(stack))
    assert json.loads(out)["last_seq"] == 9
    code, out, _ = await tollgate(
        capsys, "runs", "stream", run_id, "--after", "3", *stack_args(stack)
    )
    assert (code, out) == (0, "lo, world\n")
    code, out, _ = await tollgate(capsys, "runs", "list", "--limit", "5", *stack_args(stack))
    assert out.splitlines()[0].split() == ["RUN_ID", "STATE", "MODEL", "OUTPUT_TOKENS", "CREATED"]
    assert run_id in out
    code, out, _ = await tollgate(capsys, "runs", "cancel", run_id, *stack_args(stack))
    assert out == f"run {run_id}: billed\n"  # it had ended: cancelling leaves it as it is
    fake.gateway.runs["going"] = script("going", ["a"], end="running")
    code, out, _ = await tollgate(capsys, "runs", "cancel", "going", *stack_args(stack))
    assert out == "run going: cancelled\n"
    code, _, err = await tollgate(capsys, "runs", "get", "nope", *stack_args(stack))
    assert code == 1 and err.startswith("error: NOT_FOUND: ")


async def test_usage_entries_and_reconcile(
    fake: FakeServer, stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = await tollgate(capsys, "usage", *stack_args(stack), "--since", "2026-01-01")
    assert code == 0
    assert out.splitlines()[0] == "tenant tenant-1  runs 2  total 1.500300 USD"
    assert "output_tokens  50        1.500000" in out
    [(_, request, metadata)] = fake.ledger.calls
    assert request.HasField("start_time") and not request.HasField("end_time")
    assert metadata["authorization"] == f"Bearer {API_KEY}"
    await tollgate(capsys, "usage", "--tenant", "t-9", *stack_args(stack))
    assert fake.ledger.calls[-1][2]["authorization"] == f"Bearer {ADMIN_TOKEN}"
    code, out, _ = await tollgate(capsys, "usage", "--entries", *stack_args(stack))
    assert "output_tokens" in out and "0.000010" in out
    code, out, _ = await tollgate(capsys, "usage", "--reconcile", *stack_args(stack))
    assert code == 0 and out.startswith("ok")
    fake.ledger.reconciliation_ok = False
    code, out, _ = await tollgate(capsys, "usage", "--reconcile", *stack_args(stack))
    assert code == 1 and "unbilled r9" in out
    code, _, err = await tollgate(capsys, "usage", "--since", "yesterday", *stack_args(stack))
    assert code == 2 and "not an ISO 8601 time" in err


async def test_admin_commands(
    fake: FakeServer, stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = stack_args(stack)
    code, out, _ = await tollgate(
        capsys, "admin", "tenants", "create", "acme", "--weight", "3", *args
    )
    assert code == 0 and "name:" in out and "acme" in out
    assert fake.admin.calls[0][2]["authorization"] == f"Bearer {ADMIN_TOKEN}"
    code, out, _ = await tollgate(capsys, "admin", "tenants", "list", *args)
    # A new tenant runs DEFAULT_MAX_CONCURRENT_RUNS at once until its quota says otherwise.
    assert out.splitlines()[1].split() == ["t-1", "acme", "3", "unlimited", "64"]
    code, out, _ = await tollgate(capsys, "admin", "tenants", "get", "t-1", "--json", *args)
    assert json.loads(out)["weight"] == 3
    code, out, err = await tollgate(capsys, "admin", "keys", "create", "t-1", *args)
    assert code == 0 and out.count("tg_secret_1") == 1 and "shown only once" in err
    code, out, _ = await tollgate(capsys, "admin", "keys", "revoke", "k-1", *args)
    assert "True" in out and "tg_secret" not in out
    await tollgate(capsys, "admin", "quota", "set", "t-1", "--max-kv-blocks", "64", *args)
    code, out, _ = await tollgate(
        capsys, "admin", "quota", "set", "t-1", "--max-concurrent-runs", "2", *args
    )
    assert out == "tenant t-1: max_kv_blocks=64 max_concurrent_runs=2\n"


async def test_admin_keys_commands(
    fake: FakeServer, stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = stack_args(stack)
    await tollgate(capsys, "admin", "tenants", "create", "acme", *args)
    code, out, err = await tollgate(
        capsys, "admin", "keys", "create", "t-1", "--model", "m1", "--model", "m2",
        "--expires", "2030-01-31T12:00:00Z", "--alias", "ci bot", "--json", *args,
    )  # fmt: skip
    assert code == 0 and "shown only once" in err
    created = json.loads(out)
    assert created["secret"] == "tg_secret_1" and created["allowed_models"] == ["m1", "m2"]
    sent = [r for name, r, _ in fake.admin.calls if name == "CreateApiKey"][0]
    assert sent.alias == "ci bot" and sent.expire_time.seconds == 1_896_091_200
    await tollgate(capsys, "admin", "keys", "create", "t-1", "--expires", "30d", *args)
    code, out, _ = await tollgate(capsys, "admin", "keys", "list", "t-1", *args)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3 and "tg_secret" not in out
    assert lines[1].split()[:4] == ["k-1", "ci", "bot", "m1,m2"]
    assert lines[2].split()[1] == "*"
    code, out, _ = await tollgate(capsys, "admin", "keys", "list", "t-1", "--json", *args)
    assert [json.loads(line)["key_id"] for line in out.splitlines()] == ["k-1", "k-2"]
    assert all("secret" not in json.loads(line) for line in out.splitlines())
    code, out, err = await tollgate(
        capsys, "admin", "keys", "rotate", "k-1", "--overlap", "90m", *args
    )
    assert code == 0 and "tg_rotated_k-1" in out and "old secret works until" in err
    rotate = [r for name, r, _ in fake.admin.calls if name == "RotateApiKey"][0]
    assert rotate.overlap.seconds == 5400
    code, _, err = await tollgate(
        capsys, "admin", "keys", "rotate", "k-1", "--overlap", "soon", *args
    )
    assert code == 2 and "not a duration" in err


def test_key_times_read_from_the_command_line() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    assert moment("12h", now) == now + timedelta(hours=12)
    assert moment("2030-02-01", now) == datetime(2030, 2, 1, tzinfo=UTC)
    assert moment("2030-02-01T00:00:00+01:00", now).utcoffset() == timedelta(hours=1)
    assert (seconds("90"), seconds("1.5m"), seconds("7d")) == (90, 90, 7 * 86400)
    with pytest.raises(argparse.ArgumentTypeError):
        moment("next week", now)


async def test_quotas_set_takes_every_limit_and_keeps_the_ones_not_given(
    fake: FakeServer, stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = stack_args(stack)
    await tollgate(capsys, "admin", "tenants", "create", "acme", *args)
    await tollgate(capsys, "admin", "quotas", "set", "t-1", "--requests-per-minute", "10", *args)
    code, out, _ = await tollgate(
        capsys, "admin", "quotas", "set", "t-1", "--budget-micros", "5000",
        "--budget-period", "day", "--output-tokens-per-minute", "900", *args,
    )  # fmt: skip
    sent = fake.admin.calls[-1][1].quota
    assert (sent.requests_per_minute, sent.budget_micros, sent.budget_period) == (10, 5000, "day")
    assert sent.output_tokens_per_minute == 900 and sent.key_id == ""
    assert code == 0 and "requests_per_minute=10" in out and "budget_period=day" in out


async def test_secrets_never_reach_the_output(
    fake: FakeServer, stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.gateway.generate_error = InvalidArgument([FieldViolation("model", "unknown")])
    for argv in (("generate", "Hi"), ("runs", "list"), ("usage",), ("admin", "tenants", "list")):
        _, out, err = await tollgate(capsys, *argv, *stack_args(stack))
        assert API_KEY not in out + err and ADMIN_TOKEN not in out + err


def test_money_is_exact() -> None:
    assert money(1_500_300, "USD") == "1.500300 USD"
    assert money(-5) == "-0.000005"
    assert money(10**18 + 1) == "1000000000000.000001"
