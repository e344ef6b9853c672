"""A bandwidth-limited network between local processes, from Linux network namespaces.

Stands in for an inter-node network on one machine: every process gets its own namespace
(``<prefix>-p<i>``) with one veth link into a bridge in a hub namespace (``<prefix>-hub``), and
each link is shaped with ``tc ... tbf`` at ``rate`` in both directions (process egress and hub
egress), like a full-duplex NIC of that speed per node. Addresses are ``10.200.<subnet>.<i+1>``
on the veths only, inside namespaces this module creates; nothing outside them is touched.

Needs root, ``ip`` (iproute2) with netns/veth/bridge support and ``tc``. :func:`available`
says whether it works here (and why not). :func:`run_in_namespaces` is the counterpart of
:func:`ciera_harness.launch.run_local`: it runs ``python -m MODULE`` once per namespace with the
same ``CIERA_*`` environment, the coordinator on process 0's veth address, and
``CIERA_GLOO_HOSTNAME`` set so gloo binds to the veth address (the hostname of the machine
resolves to 127.0.0.1 in every namespace, which peers in other namespaces cannot reach); the
child applies it with :func:`apply_gloo_hostname` before JAX starts its CPU backend.

    with LimitedLink(num=2, rate="1gbit") as link:
        outs = run_in_namespaces(link, "my_worker", [], local_devices=1)
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys

from ciera_harness.launch import child_env, collect, failure_report

MTU = 9000  # jumbo frames, as on datacenter links


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def available() -> tuple[bool, str]:
    """``(True, "")`` when namespaces, veth, a bridge and tc tbf can be set up here."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "not a POSIX system"
    if os.geteuid() != 0:
        return False, "needs root to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found (apt-get install -y iproute2)"
    try:
        with LimitedLink(num=2, rate="100mbit", prefix=f"cnchk{os.getpid() % 10000}",
                         subnet=250):
            pass
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        err = getattr(e, "stderr", "") or str(e)
        return False, f"network namespace setup failed: {err.strip()[:300]}"
    return True, ""


class LimitedLink:
    """Context manager: ``num`` namespaces on a bridge, each link shaped to ``rate``
    (a tc rate such as ``"1gbit"``, or None for an unshaped veth). Torn down on exit."""

    def __init__(self, num: int, rate: str | None, prefix: str | None = None, subnet: int = 200,
                 mtu: int = MTU):
        self.num, self.rate, self.mtu = num, rate, mtu
        self.prefix = prefix or f"ciera{os.getpid() % 100000}"
        self.subnet = subnet
        self.hub = f"{self.prefix}-hub"
        self.namespaces = [f"{self.prefix}-p{i}" for i in range(num)]
        self.ips = [f"10.200.{subnet}.{i + 1}" for i in range(num)]
        self._made: list[str] = []

    def __enter__(self) -> "LimitedLink":
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _setup(self) -> None:
        self._add_ns(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "mtu", str(self.mtu), "up")
        for i, (ns, addr) in enumerate(zip(self.namespaces, self.ips)):
            self._add_ns(ns)
            host_end, ns_end = f"h{i}", "eth0"
            _ip("link", "add", "name", host_end, "netns", self.hub, "mtu", str(self.mtu),
                "type", "veth", "peer", "name", ns_end, "netns", ns, "mtu", str(self.mtu))
            _ip("-n", self.hub, "link", "set", host_end, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ns_end)
            _ip("-n", ns, "link", "set", ns_end, "up")
            if self.rate:
                for where, dev in ((ns, ns_end), (self.hub, host_end)):
                    self._shape(where, dev)

    def _shape(self, ns: str, dev: str) -> None:
        shape_link(ns, dev, self.rate)

    def close(self) -> None:
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[i]]


def shape_link(ns: str, dev: str, rate: str | None) -> None:
    """Shape ``dev`` in namespace ``ns`` to ``rate`` with tc tbf (``replace``: whether or not it
    was shaped before); ``rate`` None removes the shaping."""
    if rate is None:
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                       capture_output=True, text=True, check=False, timeout=30)
        return
    burst = max(64 * 1024, rate_bits(rate) // 8 // 250)  # ~4 ms at line rate, >= a jumbo frame
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                    "tbf", "rate", rate, "burst", str(burst), "latency", "20ms"],
                   capture_output=True, text=True, check=True, timeout=30)


def set_own_rate(rate: str | None) -> None:
    """In a child of :func:`run_in_namespaces`: shape this process's link (its veth and the
    hub's end of it) to ``rate``, or unshape it (None). The other processes set theirs; a
    barrier after it is the caller's."""
    hub, i = os.environ["CIERA_NETNS_HUB"], int(os.environ["CIERA_PROCESS_ID"])
    own = os.environ["CIERA_NETNS_SELF"]
    shape_link(own, "eth0", rate)
    shape_link(hub, f"h{i}", rate)


def rate_bits(rate: str) -> int:
    """Bits per second of a tc rate such as ``1gbit`` or ``300mbit``."""
    r = rate.lower().strip()
    for suffix, mult in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if r.endswith(suffix):
            return int(float(r[: -len(suffix)]) * mult)
    raise ValueError(f"rate {rate!r}: use a tc rate such as 1gbit or 100mbit")


def apply_gloo_hostname() -> None:
    """In a child: make gloo bind to ``$CIERA_GLOO_HOSTNAME`` (call before JAX's CPU backend
    starts, i.e. before ``init_from_env``). No-op when the variable is unset."""
    host = os.environ.get("CIERA_GLOO_HOSTNAME")
    if not host:
        return
    from jax._src.lib import _jax

    orig = _jax.make_gloo_tcp_collectives

    def make(distributed_client, hostname=None, interface=None):
        return orig(distributed_client=distributed_client, hostname=hostname or host,
                    interface=interface)

    _jax.make_gloo_tcp_collectives = make


def run_in_namespaces(link: LimitedLink, module: str, args: list[str], *, local_devices: int,
                      timeout_s: float = 300, env: dict | None = None) -> list[str]:
    """Run ``python -m module args`` in each of ``link``'s namespaces; returns their stdout.
    Raises RuntimeError with the children's output if any exits non-zero."""
    port = random.randint(20000, 60000)  # fresh namespaces: every port is free
    coordinator = f"{link.ips[0]}:{port}"
    procs = [subprocess.Popen([*link.exec_prefix(pid), sys.executable, "-m", module, *args],
                              env=child_env(coordinator, link.num, pid, local_devices, env,
                                            CIERA_GLOO_HOSTNAME=link.ips[pid],
                                            CIERA_NETNS_HUB=link.hub,
                                            CIERA_NETNS_SELF=link.namespaces[pid]),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in range(link.num)]
    outs, codes = collect(procs, timeout_s)
    if any(c != 0 for c in codes):
        raise RuntimeError(f"namespace run of {module} failed:\n{failure_report(outs, codes)}")
    return outs
