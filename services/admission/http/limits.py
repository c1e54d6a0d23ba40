"""What one client may take of admission's HTTP port: per connection (`connections.py`,
enforced as uvicorn reads) and per request body (`guard.py`, before FastAPI parses it).
Read from the environment by `services.admission.app`; docs/SECURITY.md lists them."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

MiB = 1024 * 1024
# The largest file `POST /v1/files` keeps (docs/BATCHES.md).
MAX_FILE_BYTES = 100 * MiB
# Above the largest valid request: 262144 characters in all, each escaped as `\uXXXX` (6
# bytes, 12 for a character outside the BMP) is 3 MiB, plus the fields around them.
DEFAULT_MAX_BODY_BYTES = 4 * MiB
# The most `max_json_depth` may be: the check's pattern nests a group per level, and
# Python's regular expression compiler recurses once per group.
MAX_JSON_DEPTH = 256


@dataclass(frozen=True, slots=True)
class HttpLimits:
    # Request bodies, on every route (a `/v1/` route's only after the key is checked).
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # A file upload's body (`POST /v1/files`): the largest file and its form around it.
    max_upload_bytes: int = MAX_FILE_BYTES + MiB
    max_json_depth: int = 64
    # Connections open at once: in the process, and from one client address.
    max_connections: int = 4096
    max_connections_per_client: int = 256
    # A request's line and headers: bytes in all, and headers.
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    # Seconds from the connection (or the request's first byte) to the end of the
    # headers, and from there to the end of the body.
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    # Addresses or networks (CIDR) of the proxies whose `X-Forwarded-For` names the
    # client; none by default, so the client is the transport peer.
    trusted_proxies: tuple[str, ...] = ()
    # Seconds a Responses API response stays retrievable (TOLLGATE_RESPONSES_RETENTION).
    responses_retention: float = 7 * 24 * 3600.0

    def proxy_networks(self) -> tuple[Network, ...]:
        """`trusted_proxies` parsed; raises ValueError for one that is not an address."""
        return tuple(ipaddress.ip_network(proxy, strict=False) for proxy in self.trusted_proxies)


DEFAULT_LIMITS = HttpLimits()


def is_within(host: str, networks: tuple[Network, ...]) -> bool:
    """Whether the peer address `host` is in one of `networks`."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(address in network for network in networks)
