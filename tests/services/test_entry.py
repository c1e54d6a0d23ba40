"""`python -m services.<name>`: every service starts the same way, and a bad setting ends
it at once with status 2 and a message naming the variable."""

import os
import subprocess
import sys

import pytest

SERVICES = ("admission", "scheduler", "worker", "ledger")
VALID = {
    "TOLLGATE_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
    "TOLLGATE_KAFKA_BOOTSTRAP": "127.0.0.1:1",
    "TOLLGATE_MODELS": "tiny=/nonexistent",
}


def start(name: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    return subprocess.run(
        [sys.executable, "-m", f"services.{name}"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("name", SERVICES)
def test_a_missing_database_url_exits_2_naming_it(name: str) -> None:
    settings = {k: v for k, v in VALID.items() if k != "TOLLGATE_DATABASE_URL"}
    done = start(name, settings)
    assert done.returncode == 2, done.stderr
    assert f"{name}: TOLLGATE_DATABASE_URL is required" in done.stderr


@pytest.mark.parametrize("name", SERVICES)
def test_an_unknown_event_loop_exits_2_naming_it(name: str) -> None:
    done = start(name, {**VALID, "TOLLGATE_EVENT_LOOP": "twisted"})
    assert done.returncode == 2, done.stderr
    assert f"{name}: TOLLGATE_EVENT_LOOP must be one of" in done.stderr


# The services with a public port: they take the admin token and the TLS files.
PUBLIC = ("admission", "ledger")


@pytest.mark.parametrize("name", PUBLIC)
def test_a_short_admin_token_exits_2_naming_it(name: str) -> None:
    done = start(name, {**VALID, "TOLLGATE_ADMIN_TOKEN": "x" * 15})
    assert done.returncode == 2, done.stderr
    assert f"{name}: TOLLGATE_ADMIN_TOKEN must be at least 16 characters long" in done.stderr


@pytest.mark.parametrize("name", PUBLIC)
@pytest.mark.parametrize(
    ("given", "named"),
    [("TOLLGATE_TLS_CERT", "TOLLGATE_TLS_KEY"), ("TOLLGATE_TLS_KEY", "TOLLGATE_TLS_CERT")],
)
def test_half_a_tls_pair_exits_2_naming_the_other_half(name: str, given: str, named: str) -> None:
    done = start(name, {**VALID, given: "/etc/hostname"})
    assert done.returncode == 2, done.stderr
    assert f"{name}: {named} is required when {given} is set" in done.stderr


@pytest.mark.parametrize("name", PUBLIC)
def test_an_unreadable_tls_file_exits_2_naming_it(name: str) -> None:
    missing = "/nonexistent/tls.pem"
    done = start(name, {**VALID, "TOLLGATE_TLS_CERT": missing, "TOLLGATE_TLS_KEY": missing})
    assert done.returncode == 2, done.stderr
    assert f"{name}: TOLLGATE_TLS_CERT: cannot read {missing}" in done.stderr
