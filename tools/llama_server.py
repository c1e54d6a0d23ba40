"""Builds llama.cpp's `llama-server` from source once per user and prints its path.

`python -m tools.llama_server` (or `make llama-server`). The source is the llama.cpp that
the `llama-cpp-python` sdist carries in `vendor/llama.cpp`; it is fetched with pip from
the package index and built with CMake and ninja. The binary is cached under the user's
cache directory (`$TOLLGATE_LLAMA_SERVER` names another binary to use instead), so a
second call returns at once. Used by the tests and benchmarks that run Tollgate in front
of a real llama-server.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from engine.user_cache import user_cache

SDIST = "llama-cpp-python==0.3.36"
# Built without ggml's AMX kernels: where the CPU has AMX but the system grants a process
# no AMX tile state, they crash at the first decode (SIGSEGV in ggml_backend_amx_mul_mat).
# GCC keeps an explicit -mno-* over what -march=native implies; the AVX-512 kernels, and
# the weight repacking they use, stay.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILD = "no-amx"
VARIABLE = "TOLLGATE_LLAMA_SERVER"


def binary_path() -> Path:
    """Where the built binary is (or will be): `$TOLLGATE_LLAMA_SERVER` when set."""
    configured = os.environ.get(VARIABLE)
    if configured:
        return Path(configured)
    return (
        user_cache("llama-server", "TOLLGATE_LLAMA_SERVER_DIR")
        / f"{SDIST.replace('==', '-')}-{BUILD}"
        / "llama-server"
    )


def find() -> Path | None:
    """The binary when it is built, else None."""
    path = binary_path()
    return path if path.is_file() and os.access(path, os.X_OK) else None


def build(jobs: int | None = None) -> Path:
    """Fetches the sdist, builds `llama-server` and installs it at `binary_path()`."""
    found = find()
    if found is not None:
        return found
    target = binary_path()
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise SystemExit(f"building llama-server needs {tool} on PATH")
    with tempfile.TemporaryDirectory(prefix="tollgate-llama-") as scratch:
        work = Path(scratch)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", ":all:", "--dest", str(work), SDIST],
            check=True,
        )  # fmt: skip
        [archive] = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        [source] = work.glob("llama_cpp_python-*/vendor/llama.cpp")
        build_dir = work / "build"
        subprocess.run(
            ["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja",
             "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"],
            check=True,
        )  # fmt: skip
        command = ["cmake", "--build", str(build_dir), "--target", "llama-server"]
        if jobs:
            command += ["-j", str(jobs)]
        subprocess.run(command, check=True)
        [built] = build_dir.glob("bin/llama-server")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        shutil.copy2(built, partial)
        partial.replace(target)  # whole or absent, even if the build is stopped
    return target


class LlamaServer:
    """A `llama-server` process serving one GGUF file on a local port, as its users run it:
    `slots` parallel sequences with its own continuous batching. `start` waits until it
    answers `/health`; `kill` stops it at once (SIGKILL), `start` again brings it back on
    the same port."""

    def __init__(
        self,
        gguf: Path,
        *,
        port: int = 0,
        slots: int = 4,
        context: int = 4096,
        threads: int = 2,
        log: Path | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        binary = find()
        if binary is None:
            raise FileNotFoundError(
                f"llama-server is not built; run `make llama-server` ({binary_path()})"
            )
        self.command = [
            str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port or _free_port()),
            "-np", str(slots), "-c", str(context), "-t", str(threads), "--metrics", *extra_args,
        ]  # fmt: skip
        self.port = int(self.command[self.command.index("--port") + 1])
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> LlamaServer:
        output = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(self.command, stdout=output, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"llama-server did not answer within {timeout} s")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs")
    args = parser.parse_args()
    print(build(args.jobs))


if __name__ == "__main__":
    main()
