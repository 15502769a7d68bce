"""Host names as the servers and clients of mogrpo judge them."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback: `localhost`, 127.0.0.0/8
    or ::1. Other names are not resolved."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return False
