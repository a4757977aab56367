"""Hosts on one machine: network namespaces, each with its own address on a bridge.

Each host is a namespace with a veth pair: one end inside (its address), the other on a bridge
in the root namespace, which has an address too, so that this machine reaches every host (the
load generator runs here). A partition takes a host's link down from inside: its packets are
dropped, no RST is sent, as when a cable is pulled; `impair` delays or drops a share of them.
Names carry a tag unique to the run, and `remove` deletes everything made, also after a
failure. Needs root and iproute2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass
class Hosts:
    count: int = 3
    tag: str = field(default_factory=lambda: f"lb{os.getpid() % 100000}")
    subnet: str = field(default_factory=lambda: f"10.213.{os.getpid() % 200 + 20}")
    made: list[tuple[str, str]] = field(default_factory=list)  # (kind, name), to remove
    netem: bool = False  # whether the kernel has tc netem (`impairments` finds out)

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    def namespace(self, host: int) -> str:
        return f"{self.tag}h{host}"

    def address(self, host: int) -> str:
        """Host 1, 2, ... (0: this machine, on the bridge)."""
        return f"{self.subnet}.{host if host else 254}"

    def _link(self, host: int) -> str:
        return f"{self.tag}n{host}"  # inside the host; its peer on the bridge is ...b<host>

    def create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.address(0)}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in range(1, self.count + 1):
            ns, inner, outer = self.namespace(host), self._link(host), f"{self.tag}b{host}"
            _ip("netns", "add", ns)
            self.made.append(("netns", ns))
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self.made.append(("link", outer))
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def command(self, host: int, argv: list[str]) -> list[str]:
        """`argv` run inside the host (`ip netns exec` execs it: the pid is the process's)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def partition(self, host: int, cut: bool) -> None:
        """Cut the host off (its link down: silence, no RST), or join it again."""
        _ip("-n", self.namespace(host), "link", "set", self._link(host),
            "down" if cut else "up")

    def impairments(self) -> list[str]:
        """What `impair` can do here: tc netem's delay and loss where the kernel has netem;
        else a loss by nftables (where `nft` is installed) and a link throttled by tc tbf,
        whose queue delays packets up to 200 ms and drops what overflows it (where the kernel
        has tbf). Each is tried once on the host's loopback. Nothing: an empty list."""
        def works(*qdisc: str) -> bool:
            run = ["ip", "netns", "exec", self.namespace(1), "tc", "qdisc"]
            made = subprocess.run([*run, "add", "dev", "lo", "root", *qdisc], capture_output=True)
            subprocess.run([*run, "del", "dev", "lo", "root"], capture_output=True)
            return made.returncode == 0

        self.netem = works("netem", "delay", "1ms")
        if self.netem:
            return ["delay 200ms", "loss 5%"]
        throttle = works("tbf", "rate", "1mbit", "burst", "16kb", "latency", "200ms")
        return ["throttle 1mbit"] * throttle + ["loss 5%"] * bool(shutil.which("nft"))

    def impair(self, host: int, how: str | None) -> None:
        """Impair the host's link as `how` (one of `impairments()`), or mend it (None)."""
        run = ["ip", "netns", "exec", self.namespace(host)]
        table = f"{self.tag}chaos"
        if how is None:  # whichever was made: the other is not there, nothing to undo
            subprocess.run([*run, "tc", "qdisc", "del", "dev", self._link(host), "root"],
                           capture_output=True)
            subprocess.run([*run, "nft", "delete", "table", "inet", table], capture_output=True)
            return
        if how.startswith("throttle"):
            qdisc = ["tbf", "rate", how.split()[1], "burst", "16kb", "latency", "200ms"]
        elif self.netem:
            qdisc = ["netem", *how.split()]
        else:  # a share of the packets dropped both ways, by nftables
            percent = how.split()[1].rstrip("%")
            for command in (f"add table inet {table}",
                            f"add chain inet {table} in {{ type filter hook input priority 0; }}",
                            f"add chain inet {table} out {{ type filter hook output priority 0; }}",
                            f"add rule inet {table} in numgen random mod 100 < {percent} drop",
                            f"add rule inet {table} out numgen random mod 100 < {percent} drop"):
                subprocess.run([*run, "nft", *command.split()], check=True, capture_output=True)
            return
        subprocess.run([*run, "tc", "qdisc", "replace", "dev", self._link(host), "root", *qdisc],
                       check=True, capture_output=True)

    def remove(self) -> None:
        for kind, name in reversed(self.made):
            subprocess.run(["ip", kind, "del", name], capture_output=True)
        self.made.clear()
