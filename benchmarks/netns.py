"""Network namespaces joined by veth pairs: a cross-host stand-in on one machine (root only).

:class:`Hosts` creates ``count`` namespaces, each with one veth (``eth0``, ``subnet``.(i+1)/24, 10.213.0 by default)
whose other end sits on a bridge in a hub namespace, so every pair talks over two veths and a
bridge and nothing touches the root namespace's interfaces. Each namespace also gets its own UTS
namespace when processes are started through :meth:`Hosts.popen` (hostname ``fbhost<i>``), so
FlashBoot sees different hosts. :meth:`Hosts.link`, :meth:`Hosts.silence`, :meth:`Hosts.blackhole`
and :meth:`Hosts.rate` make the network misbehave (a cut cable, packets to one host silently
dropped, an address that routes nowhere, a slow link).
:meth:`Hosts.close` deletes them all (the veths and their impairments go with them).
Used by the NIXL tests and by ``python -m flashboot.benchmarks.nixl_netns``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from flashboot.errors import CapabilityError

SUBNET = "10.213.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def cannot_create() -> str:
    """Why this machine cannot create namespaces ("" when it can): probes by creating one."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if shutil.which("unshare") is None:
        return "no `unshare` command (util-linux)"
    if os.geteuid() != 0:
        return f"not root (uid {os.geteuid()}): ip netns needs CAP_NET_ADMIN"
    name = f"fbprobe{os.getpid()}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return ""


class Hosts:
    """``count`` namespaces on one bridge; ``address(i)``, ``popen(i, argv)``, ``rx_bytes(i)``, ``close()``."""

    def __init__(self, count: int, tag: str = "", subnet: str = SUBNET):
        why = cannot_create()
        if why:
            raise CapabilityError(f"cannot create network namespaces: {why}")
        self.subnet = subnet  # a /24 of its own per user: tests of several files may run side by side
        self.prefix = f"fb{os.getpid()}{tag}"
        self.hub = f"{self.prefix}h"
        self.names = [f"{self.prefix}n{i}" for i in range(count)]
        self._made: list[str] = []
        try:
            self._add(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                self._add(ns)
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.hub)
                _ip("-n", self.hub, "link", "set", f"p{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def argv(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run in namespace ``i`` with its own hostname (``fbhost<i>``)."""
        inner = f"hostname fbhost{i} && exec \"$@\""
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c", inner, "sh", *argv]

    def popen(self, i: int, argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        return subprocess.Popen(self.argv(i, argv), env=env, **kw)

    def python(self, i: int, code: str, env: dict | None = None, **kw) -> subprocess.Popen:
        return self.popen(i, [sys.executable, "-c", code], env=env, **kw)

    def link(self, i: int, up: bool) -> None:
        """Bring namespace ``i``'s veth up or down (a cut cable)."""
        _ip("-n", self.names[i], "link", "set", "eth0", "up" if up else "down")

    def silence(self, i: int, j: int, on: bool = True) -> None:
        """Make namespace ``i``'s packets to namespace ``j`` (its IPv4 address and its IPv6 link-local
        one, which UCX also connects to) vanish without a word, as behind a firewall that drops
        them, or undo it; every other pair still talks. A permanent neighbour entry to a MAC nobody
        has: tc's netem, iptables and nft are absent from some kernels, this needs only iproute2."""
        for address in (self.address(j), *self._link_local(j)):
            if on:
                _ip("-n", self.names[i], "neigh", "replace", address, "lladdr", "02:00:00:00:00:fb", "dev", "eth0",
                    "nud", "permanent")
            else:
                _ip("-n", self.names[i], "neigh", "del", address, "dev", "eth0", check=False)

    def blackhole(self, i: int, j: int, on: bool = True) -> None:
        """In namespace ``i``, route namespace ``j``'s addresses nowhere (``ip route add blackhole``),
        or remove those routes: packets to ``j`` are dropped before they leave, a connect fails at once."""
        for address, bits in ((self.address(j), 32), *((a, 128) for a in self._link_local(j))):
            _ip("-n", self.names[i], "route", "add" if on else "del", "blackhole", f"{address}/{bits}",
                check=on)

    def rate(self, i: int, rate: str | None) -> None:
        """Limit namespace ``i``'s link to ``rate`` (``"20mbit"``) both ways with a token bucket
        (``tc ... tbf``), or lift the limit (None): a slow link, so a fault can land mid-transfer."""
        for ns, dev in ((self.names[i], "eth0"), (self.hub, f"p{i}")):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True,
                           timeout=20)
            if rate is not None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                                rate, "burst", "64kb", "latency", "400ms"], capture_output=True, text=True, check=True,
                               timeout=20)

    def _link_local(self, j: int) -> list[str]:
        out = _ip("-n", self.names[j], "-j", "addr", "show", "eth0").stdout
        return [a["local"] for a in json.loads(out)[0].get("addr_info", [])
                if a.get("family") == "inet6" and a.get("scope") == "link"]

    def rx_bytes(self, i: int) -> int:
        """Bytes namespace ``i``'s veth has received (``ip -s link``)."""
        out = _ip("-n", self.names[i], "-s", "-j", "link", "show", "eth0").stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])

    def tx_bytes(self, i: int) -> int:
        out = _ip("-n", self.names[i], "-s", "-j", "link", "show", "eth0").stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def close(self) -> None:
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made = []

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
