"""Wheels built in the test, to serve to pip from a local directory."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def build_wheel(into: Path, package: str, version: str, files: dict[str, Path]) -> Path:
    """A pure-Python wheel of `package` holding `files` (member path -> file)."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
    wheel_meta = "Wheel-Version: 1.0\nGenerator: tollgate-tests\nRoot-Is-Purelib: true\n"
    wheel_meta += "Tag: py3-none-any\n"
    into.mkdir(parents=True, exist_ok=True)
    path = into / f"{dist}-{version}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for member, source in files.items():
            archive.write(source, member)
            record.append(_record_line(member, source.read_bytes()))
        for member, text in ((f"{info}/METADATA", metadata), (f"{info}/WHEEL", wheel_meta)):
            archive.writestr(member, text)
            record.append(_record_line(member, text.encode()))
        record.append(f"{info}/RECORD,,")
        archive.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def _record_line(member: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{member},sha256={digest},{len(data)}"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
