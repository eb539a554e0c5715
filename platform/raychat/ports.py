"""Free TCP ports for a service this machine is about to start (a local Ray cluster's GCS, RL learners'
torch.distributed rendezvous, the tests' servers), chosen where only a bind by number can take them.

The kernel hands out ports of its ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by
default) to every bind to port 0 and every outgoing connection, and a starting Ray instance takes dozens: a
port found free there and released can be handed to some client socket before its service binds it (seen:
`raychat serve` "cannot listen on 127.0.0.1:37889 (in use?)" after its own ray.init). A `ray start` node's
workers take 10002-19999 (its --min/--max-worker-port defaults). free_ports picks between the two.
"""

from __future__ import annotations

import random
import socket
from contextlib import ExitStack

PORT_LOW = 20000  # above a `ray start` node's worker ports
MIN_SPAN = 1000  # ports to choose from even where the ephemeral range starts below PORT_LOW + MIN_SPAN
TRIES_PER_PORT = 200


def port_range() -> tuple[int, int]:
    """(low, high), both inclusive: PORT_LOW up to the port below the kernel's ephemeral range (32767 where
    /proc/sys/net/ipv4/ip_local_port_range cannot be read), high at least PORT_LOW + MIN_SPAN."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_start = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_start = 32768
    return PORT_LOW, max(ephemeral_start - 1, PORT_LOW + MIN_SPAN)


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports (ints in port_range()) that nothing on this machine is bound to now, on any
    address: each is checked by binding it on all interfaces, and those sockets stay open until all n are
    chosen, so none repeats. Drawn with SystemRandom, which a seeded run's `random` does not make repeat.

    Raises:
        ValueError: n < 1.
        OSError: fewer than n free ports found in 200 * n tries.
    """
    if n < 1:
        raise ValueError(f"free_ports: n must be >= 1, got {n}")
    low, high = port_range()
    pick = random.SystemRandom()
    ports: list[int] = []
    with ExitStack() as stack:
        for _ in range(TRIES_PER_PORT * n):
            port = pick.randint(low, high)
            if port in ports:
                continue
            s = socket.socket()
            try:
                s.bind(("", port))
            except OSError:
                s.close()
                continue
            stack.enter_context(s)
            ports.append(port)
            if len(ports) == n:
                return ports
    raise OSError(
        f"found {len(ports)} of {n} free TCP ports in {low}-{high} after {TRIES_PER_PORT * n} tries"
    )
