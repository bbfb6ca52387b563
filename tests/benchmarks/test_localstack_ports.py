"""The local stack's ports stay clear of the kernel's ephemeral range, so a process started again
on its port cannot find it taken by the local end of an outgoing connection."""

import socket

import pytest

from kv_picker_bench import localstack
from kv_picker_bench.localstack import free_port


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = localstack._ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert not any(low <= port <= high for port in ports)
    for port in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


class _Sequence:
    """Stands in for the port chooser's random draws."""

    def __init__(self, *ports: int) -> None:
        self.ports = list(ports)

    def choice(self, _: range) -> int:
        return self.ports.pop(0)


def test_a_port_in_use_or_already_issued_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    issued = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        in_use = held.getsockname()[1]
        monkeypatch.setattr(localstack, "_EPHEMERAL", (60000, 60999))  # in_use is below it
        spare = next(p for p in range(20000, 30000) if p not in localstack._ISSUED and p != issued)
        monkeypatch.setattr(localstack, "_PORT_RNG", _Sequence(in_use, issued, spare))
        assert free_port() == spare
