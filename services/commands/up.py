"""`tollgate up`: the whole stack on this machine, until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import signal
import threading
from pathlib import Path
from typing import Any

import structlog

from engine.adapters import read_adapter_config
from engine.dialects import KINDS as REMOTE_KINDS
from engine.errors import EngineError
from engine.model_dirs.fetch import FetchError, resolve_model
from services.core.db import open_db
from services.core.telemetry import configure_logging
from services.stack.bootstrap import demo_key
from services.stack.infra import LocalInfra, without_password, write_private
from services.stack.launcher import (
    SERVICE_NAMES,
    ServiceProcess,
    Services,
    StackConfig,
    Stopped,
    parse_replicas,
)
from services.stack.server_process import InfraError
from services.stack.supervisor import Supervisor
from services.worker.engines import BUILTIN, ENGINE_KINDS

DEFAULT_DATA_DIR = Path(".tollgate/stack")
STACK_FILE = "stack.json"
DEMO_MODEL = "tiny"

log = structlog.get_logger(__name__)


def register(subparsers: Any) -> None:
    up = subparsers.add_parser("up", help="start PostgreSQL, the broker and the four services")
    up.add_argument(
        "--data-dir", type=Path, default=DEFAULT_DATA_DIR, help=f"default: {DEFAULT_DATA_DIR}"
    )
    up.add_argument(
        "--model",
        default=DEMO_MODEL,
        help=f"a Hugging Face model directory, a .gguf file, a known model such as"
        f" smollm2-135m-instruct (fetched on first use; see `tollgate models list`), or"
        f" {DEMO_MODEL} (default: a generated model with random weights)",
    )
    up.add_argument(
        "--model-name", default=None, help="the name clients use (default: the directory's name)"
    )
    up.add_argument(
        "--adapter",
        dest="adapters",
        type=_adapter,
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve the PEFT-format LoRA adapter in DIR (made for --model) as the model NAME"
        " (repeatable)",
    )
    up.add_argument(
        "--engine-kind",
        choices=ENGINE_KINDS,
        default=BUILTIN,
        help="what serves the tokens: the built-in engine, an engine server at --engine-url"
        " (vllm, sglang, llama-server, openai) or a simulated engine (sim) (default: builtin)",
    )
    up.add_argument("--engine-url", default="", help="the engine server's base URL")
    up.add_argument(
        "--engine-model",
        default="",
        help="the model's name on the engine server (default: the name clients use)",
    )
    up.add_argument(
        "--kv-blocks", type=int, default=512, help="KV cache blocks of the worker (default: 512)"
    )
    up.add_argument(
        "--port", type=int, default=50051, help="gateway port (default: 50051, 0 = any free port)"
    )
    up.add_argument(
        "--http-port",
        type=int,
        default=8080,
        help="port of the OpenAI-compatible HTTP API (default: 8080, 0 = any free port)",
    )
    up.add_argument(
        "--replicas",
        type=_replicas,
        default=parse_replicas(""),
        metavar="NAME=N,...",
        help="processes per service, e.g. admission=2,scheduler=2,worker=2,ledger=2"
        " (default: 1 each)",
    )
    up.add_argument(
        "--tls-cert",
        type=Path,
        help="PEM certificate (chain) of the gateway's, the ledger's and the HTTP API's TLS;"
        " with --tls-key (default: plaintext)",
    )
    up.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    up.set_defaults(func=up_command)


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' TOLLGATE_ENGINE_* variables for --engine-kind and its companions."""
    env = {"TOLLGATE_ENGINE_KIND": args.engine_kind}
    if args.engine_url:
        env["TOLLGATE_ENGINE_URL"] = args.engine_url
    if args.engine_model:
        env["TOLLGATE_ENGINE_MODEL"] = args.engine_model
    return env


def _replicas(text: str) -> dict[str, int]:
    try:
        return parse_replicas(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _adapter(text: str) -> tuple[str, Path]:
    name, sep, directory = text.partition("=")
    if not sep or not name.strip() or not directory.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    if "," in text:
        raise argparse.ArgumentTypeError("one adapter per --adapter (a name or path has a comma)")
    path = Path(directory.strip()).resolve()
    try:
        read_adapter_config(path)
    except EngineError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name.strip(), path


def served_adapters(args: argparse.Namespace, model_name: str) -> dict[str, Path]:
    """--adapter's adapters by name; raises ValueError on a name used twice."""
    adapters: dict[str, Path] = {}
    for name, path in args.adapters:
        if name in adapters or name == model_name:
            raise ValueError(f"--adapter {name}: the name is already taken")
        adapters[name] = path
    return adapters


def ensure_model(args: argparse.Namespace, data_dir: Path) -> tuple[str, Path]:
    if args.model != DEMO_MODEL:
        name, model_dir = resolve_model(args.model, progress=lambda line: log.info(line))
        return args.model_name or name, model_dir
    model_dir = data_dir / "models" / DEMO_MODEL
    if not (model_dir / "config.json").exists():
        from engine.model_dirs.tiny import init_tiny_model

        log.info("generating the tiny demo model", path=str(model_dir))
        init_tiny_model(model_dir)
    return args.model_name or DEMO_MODEL, model_dir.resolve()


def up_command(args: argparse.Namespace) -> int:
    configure_logging("stack")
    if (args.tls_cert is None) != (args.tls_key is None):
        log.error("--tls-cert and --tls-key go together")
        return 2
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    data_dir: Path = args.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    if (args.engine_kind in REMOTE_KINDS) != bool(args.engine_url):
        log.error("--engine-url goes with --engine-kind vllm, sglang, llama-server or openai")
        return 2
    try:
        model_name, model_dir = ensure_model(args, data_dir)
        adapters = served_adapters(args, model_name)
    except (FetchError, EngineError, ValueError) as exc:
        log.error("no model to serve", model=args.model, error=str(exc))
        return 1
    try:
        with LocalInfra(data_dir / "infra") as endpoints:
            api_key = asyncio.run(_demo_key(endpoints.database_url))
            config = StackConfig(
                database_url=endpoints.database_url,
                kafka_bootstrap=endpoints.kafka_bootstrap,
                model_name=model_name,
                model_dir=model_dir,
                adapters=adapters,
                admin_token=secrets.token_urlsafe(24),
                num_kv_blocks=args.kv_blocks,
                engine_env=engine_env(args),
                gateway_listen=f"127.0.0.1:{args.port}",
                http_listen=f"127.0.0.1:{args.http_port}",
                tls_cert=args.tls_cert.resolve() if args.tls_cert else None,
                tls_key=args.tls_key.resolve() if args.tls_key else None,
            )
            services = Services(config, data_dir / "logs", args.replicas)
            path = data_dir / STACK_FILE
            supervisor = Supervisor(services)
            try:
                try:
                    services.start(stopping)
                except Stopped:
                    log.info("stopped while starting")
                    return 0
                stack = {
                    **stack_description(services),
                    "admin_token": config.admin_token,
                    "api_key": api_key,
                    "database_url": config.database_url,
                    "kafka_bootstrap": config.kafka_bootstrap,
                    "model": model_name,
                    "model_dir": str(model_dir),
                    "adapters": {name: str(path) for name, path in adapters.items()},
                    "engine": {"kind": args.engine_kind, "url": args.engine_url},
                }
                write_stack_file(path, stack)

                def restarted(_: ServiceProcess) -> None:
                    write_stack_file(path, {**stack, **stack_description(services)})

                supervisor.on_restart = restarted
                supervisor.start()
                print(json.dumps(redacted(stack), indent=2), flush=True)
                print(f"stack file (with the admin token and API key): {path.resolve()}")
                print("Ctrl-C stops the stack.", flush=True)
                stopping.wait()
            finally:
                supervisor.stop()
                services.stop()
                path.unlink(missing_ok=True)
    except InfraError as exc:
        log.error("stack failed", error=str(exc))
        return 1
    return 0


async def _demo_key(database_url: str) -> str:
    db = open_db(database_url, pool_size=2)
    try:
        return (await demo_key(db)).secret
    finally:
        await db.dispose()


def stack_description(services: Services) -> dict[str, Any]:
    """The addresses and pids of the stack's processes, as stack.json gives them."""
    gateways = services.of("admission")
    return {
        "gateway": gateways[0].address,
        "gateways": [p.address for p in gateways],
        "http": gateways[0].endpoints["http"],
        "services": {
            service: [
                {
                    "pid": p.pid,
                    "address": p.address,
                    "metrics": f"http://127.0.0.1:{p.metrics_port}/metrics",
                }
                for p in services.of(service)
            ]
            for service in SERVICE_NAMES
        },
    }


def write_stack_file(path: Path, stack: dict[str, Any]) -> Path:
    # Only the owner may read the secrets in it; renamed into place, so that a reader
    # never sees half of it.
    partial = path.with_name(path.name + ".partial")
    write_private(partial, json.dumps(stack, indent=2) + "\n")
    partial.replace(path)
    return path.resolve()


def redacted(stack: dict[str, Any]) -> dict[str, Any]:
    """The stack description without its secrets, for printing."""
    hidden = {"admin_token": "<in stack.json>", "api_key": "<in stack.json>"}
    if "database_url" in stack:
        hidden["database_url"] = without_password(stack["database_url"])
    return {**stack, **{k: v for k, v in hidden.items() if k in stack}}
