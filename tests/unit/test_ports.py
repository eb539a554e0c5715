"""raychat.ports.free_ports: where it picks (above Ray's worker ports, below the kernel's ephemeral range), that
the n ports are distinct and free, and that a port bound on one address only is never handed out."""

import random
import socket
from pathlib import Path

import pytest

from raychat import ports
from raychat.ports import free_ports, port_range


def test_the_range_ends_below_the_kernels_ephemeral_ports():
    ephemeral_start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert port_range() == (20000, max(ephemeral_start - 1, 21000))


def test_n_distinct_ports_in_the_range_each_bindable_on_every_address():
    low, high = port_range()
    got = free_ports(40)
    assert len(got) == len(set(got)) == 40
    assert all(isinstance(p, int) and low <= p <= high for p in got)
    for port in got:
        with socket.socket() as s:
            s.bind(("", port))


def test_a_seeded_random_does_not_make_the_choice_repeat():
    state = random.getstate()
    try:
        random.seed(0)
        first = free_ports(5)
        random.seed(0)
        assert free_ports(5) != first
    finally:
        random.setstate(state)


def test_a_port_bound_on_loopback_alone_is_not_free_and_one_port_is_not_two(monkeypatch):
    (port,) = free_ports(1)
    monkeypatch.setattr(ports, "port_range", lambda: (port, port))
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        with pytest.raises(OSError, match=rf"^found 0 of 1 free TCP ports in {port}-{port} after 200 tries$"):
            free_ports(1)
    assert free_ports(1) == [port]
    with pytest.raises(OSError, match=rf"^found 1 of 2 free TCP ports in {port}-{port} after 400 tries$"):
        free_ports(2)


@pytest.mark.parametrize("n", [0, -1])
def test_n_below_one_is_refused(n):
    with pytest.raises(ValueError, match=rf"^free_ports: n must be >= 1, got {n}$"):
        free_ports(n)
