"""The endpoint: one model-server address the picker may route to.

A leaf module: the scheduling contracts, the state and the config all name endpoints, and none
of them should have to import another to do so.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NewType

EndpointId = NewType("EndpointId", int)

ROLE_LABEL = "llm-d.ai/role"


@dataclass(slots=True, frozen=True)
class EndpointSpec:
    """A configured or discovered endpoint: where it is and what it is (labels).

    ``instance`` names the server behind the address when discovery knows it (a Kubernetes
    pod's uid). A different instance at the same address is a new server, whose cache and
    counters owe nothing to the old one's: the store replaces the endpoint rather than keeping
    it. Static endpoints leave it empty.
    """

    address: str
    labels: Mapping[str, str] = field(default_factory=dict)
    instance: str = ""


@dataclass(slots=True)
class Endpoint:
    """A model-server address known to the picker.

    Attributes:
        id: dense id, index into the store's arrays.
        address: ``ip:port`` (``[v6]:port`` for IPv6), exactly as sent to Envoy.
        host: the IP part, used for subset-hint matching.
        port: the port.
        labels: static labels (role, hardware class, ...).
        instance: the server behind the address, when known (see :class:`EndpointSpec`).
    """

    id: EndpointId
    address: str
    host: str
    port: int
    labels: Mapping[str, str]
    instance: str = ""


def split_address(address: str) -> tuple[str, int]:
    """Split ``ip:port`` or ``[v6]:port`` into host and port.

    Raises:
        ValueError: when the address is not an IP literal with a port in 1..65535.
    """
    if address.startswith("["):
        host, sep, port_text = address[1:].partition("]:")
        if not sep:
            raise ValueError(f"bad address {address!r}: expected [ipv6]:port")
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep or not host:
            raise ValueError(f"bad address {address!r}: expected ip:port")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"bad address {address!r}: {host!r} is not an IP address") from None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad address {address!r}: port must be 1..65535")
    return host, int(port_text)
