"""The generated protobuf modules must match protos/ (run `make proto`)."""

from pathlib import Path

from tollgate.v1 import events_pb2, gateway_pb2
from tools import protogen


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    protogen.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "tollgate" / "v1").glob("*"))
    assert generated, "protoc produced nothing"
    stale = [
        str(path)
        for path in generated
        if not (protogen.ROOT / path).exists()
        or (protogen.ROOT / path).read_bytes() != (tmp_path / path).read_bytes()
    ]
    assert not stale, f"stale generated files, run `make proto`: {stale}"


def test_public_names_are_fixed() -> None:
    assert events_pb2.RunState.Name(7) == "RUN_STATE_BILLED"
    assert events_pb2.Priority.Name(2) == "PRIORITY_BATCH"
    kinds = [f.name for f in events_pb2.RunEvent.DESCRIPTOR.oneofs_by_name["kind"].fields]
    assert kinds == ["queued", "prefill", "streaming", "completed", "failed", "cancelled", "billed"]
    assert [f.name for f in gateway_pb2.StreamRunRequest.DESCRIPTOR.fields][:2] == [
        "run_id",
        "starting_after",
    ]
