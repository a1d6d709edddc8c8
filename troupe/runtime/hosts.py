"""Hosts on one machine: a Ray cluster across network namespaces, with shaped links and
faults as verbs (``troupe hosts``).

    troupe hosts up --hosts 3 --rate 1gbit --cpus 2     # three hosts, a Ray node in each
    troupe hosts up --hosts 4 --cpus 1 --head-cpus 0    # the head runs no workers
    troupe hosts exec 0 -- python apps/pretrain.py --config dense-tiny train.strategy=SPREAD
    troupe hosts shape 2 --rate 100mbit --loss 0.01     # host 2's link, while running
    troupe hosts cut 1 | restore 1 | kill 1 | restart 1
    troupe hosts status
    troupe hosts down                                   # every namespace, link and process

Host i is the network namespace ``<name>-h<i>`` with address 198.18.0.<i+1>/24 (198.18.0.0/15
is reserved for benchmarking and routed nowhere), joined by a veth pair to a bridge in the
namespace ``<name>-hub``. Its link is shaped in both directions with tbf (``rate``) and, for
``loss``, an nftables rule that drops that share of its packets at random (the kernel has no
netem here, so delay and jitter cannot be emulated: asking for them is refused in one line).
Host 0 runs the Ray head (GCS, dashboard on its address), every other host a Ray node that
joins it with ``--node-ip-address`` of its namespace, its own CPU count, object store and
logical GPUs; token authentication is on, with a token of the cluster's own. The driver,
``ray job submit`` and the dashboard's clients run in host 0 (``exec 0``): the root namespace
gets no leg on the bridge, so nothing outside the emulated hosts reaches them.

Faults: ``cut`` takes a host's link down at the bridge (no packet either way) and ``restore``
brings it back; ``kill`` kills every process in the host's namespace (``ip netns pids``;
never ``ray stop``, which would end every Ray process of the machine) and ``restart`` starts
its Ray node again. Ray declares a node dead after ``HEALTH_CHECK`` (period x failures) of
missed health checks: a cut shorter than that is ridden out, a longer one loses the node.

From Python, ``Hosts`` also says where things run and what crossed a link: ``find(text)``
(the hosts with a process whose command line holds it, e.g. ``ray::ServeReplica``), ``at(ip)``
(the host of an address, as a run's ``placement`` record gives them), ``tx_bytes(i)`` and
``rx_bytes(i)`` (the veth's counters).

The state (namespaces, addresses, shaping, processes) is kept in ``<state dir>/<name>/``
(``/run/troupe-hosts``, else the temporary directory), so that each verb is its own command.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from pathlib import Path

from troupe.runtime import netns
from troupe.runtime.netns import HostsError, check_tools

SUBNET = "198.18.0"
RAY_PORT = 6379
DASHBOARD_PORT = 8265
# Ray's node health checks (milliseconds): a node that misses FAILURES checks PERIOD apart is
# dead, so a link cut for less than PERIOD x FAILURES (10 s) is ridden out
HEALTH_CHECK = {"RAY_health_check_initial_delay_ms": "2000", "RAY_health_check_period_ms": "1000",
                "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "10"}


@dataclass
class Host:
    index: int
    address: str
    rate: str | None = None
    loss: float = 0.0
    cut: bool = False
    cpus: float = 1.0
    gpus: float = 0.0
    object_store_mb: int = 256
    pid: int | None = None  # the host's `ray start --block`


@dataclass
class Hosts:
    """An emulated cluster of ``hosts`` (see the module's docstring); ``Hosts.up(...)``
    makes one, ``Hosts.load(name)`` finds it again, ``down()`` removes all of it."""

    name: str
    hosts: list[Host] = field(default_factory=list)

    # ---- where things are --------------------------------------------------------------
    @staticmethod
    def state_root() -> Path:
        run = Path("/run/troupe-hosts")
        try:
            run.mkdir(parents=True, exist_ok=True)
            return run
        except OSError:
            return Path(tempfile.gettempdir()) / "troupe-hosts"

    @property
    def dir(self) -> Path:
        return self.state_root() / self.name

    @property
    def hub(self) -> str:
        return f"{self.name}-hub"

    def namespace(self, i: int) -> str:
        return f"{self.name}-h{i}"

    @property
    def address(self) -> str:
        """The Ray head's address (GCS), as RAY_ADDRESS."""
        return f"{self.hosts[0].address}:{RAY_PORT}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.hosts[0].address}:{DASHBOARD_PORT}"

    def env(self) -> dict[str, str]:
        """The environment of a process of this cluster: its token, the head's address."""
        return {**os.environ, "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN_PATH": str(self.dir / "token"), "RAY_ADDRESS": self.address,
                **HEALTH_CHECK}

    # ---- making and removing -----------------------------------------------------------
    @classmethod
    def up(cls, n: int, name: str = "trh", rate: str | None = None, loss: float = 0.0,
           cpus: float = 1.0, gpus: float = 0.0, object_store_mb: int = 256,
           timeout_s: float = 120.0, head_cpus: float | None = None) -> "Hosts":
        """``n`` hosts with a Ray node each (host 0 the head), every link at ``rate`` (tbf;
        None: unshaped) losing ``loss`` of its packets; returns once Ray counts ``n`` nodes.
        ``head_cpus``: the head's Ray CPUs when not ``cpus`` (0, as production clusters
        often have it: the head holds the GCS, the driver and Serve's proxy, no workers)."""
        check_tools(loss > 0)
        if n < 1 or n > 250:
            raise HostsError(f"--hosts {n}: between 1 and 250 hosts")
        if len(name) > 10 or not name.replace("-", "").isalnum():
            raise HostsError(f"--name {name!r}: at most 10 letters, digits or dashes")
        self = cls(name, [Host(i, f"{SUBNET}.{i + 1}", rate, loss, False,
                               cpus if i or head_cpus is None else head_cpus, gpus,
                               object_store_mb) for i in range(n)])
        if self.dir.exists() or set(netns.namespaces()) & {self.hub, self.namespace(0)}:
            raise HostsError(f"hosts {name!r} are up already: `troupe hosts down --name "
                             f"{name}` first")
        self.dir.mkdir(parents=True)
        try:
            (self.dir / "token").write_text(secrets.token_hex(32))
            os.chmod(self.dir / "token", 0o600)
            netns.ip("netns", "add", self.hub)
            netns.ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            netns.ip("-n", self.hub, "link", "set", "br0", "up")
            for h in self.hosts:
                self._make_host(h)
            self.save()
            for h in self.hosts:
                self._start_ray(h)
            self.save()
            self.wait_nodes(n, timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def _make_host(self, h: Host) -> None:
        ns = self.namespace(h.index)
        netns.ip("netns", "add", ns)
        netns.ip("-n", ns, "link", "set", "lo", "up")
        netns.ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name",
                 f"h{h.index}", "netns", self.hub)
        netns.ip("-n", ns, "addr", "add", f"{h.address}/24", "dev", "eth0")
        netns.ip("-n", ns, "link", "set", "eth0", "up")
        netns.ip("-n", self.hub, "link", "set", f"h{h.index}", "master", "br0")
        netns.ip("-n", self.hub, "link", "set", f"h{h.index}", "up")
        self._shape(h)

    def down(self) -> None:
        """Every process, namespace, link and rule of the cluster gone (the links and rules
        live in the namespaces), and its state directory."""
        for ns in [self.namespace(i) for i in range(len(self.hosts))] + [self.hub]:
            netns.kill_namespace(ns)
        for ns in [self.namespace(i) for i in range(len(self.hosts))] + [self.hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def save(self) -> None:
        (self.dir / "state.json").write_text(json.dumps(
            {"name": self.name, "hosts": [asdict(h) for h in self.hosts]}, indent=1))

    @classmethod
    def load(cls, name: str = "trh") -> "Hosts":
        path = cls.state_root() / name / "state.json"
        if not path.is_file():
            raise HostsError(f"no hosts named {name!r} are up (`troupe hosts up --name {name}`)")
        state = json.loads(path.read_text())
        return cls(state["name"], [Host(**h) for h in state["hosts"]])

    # ---- links -------------------------------------------------------------------------
    def shape(self, i: int, rate: str | None = None, loss: float | None = None) -> None:
        """Host ``i``'s link at ``rate`` (None: as it is; "none": unshaped), losing ``loss``
        of its packets (None: as it is)."""
        h = self.host(i)
        check_tools(bool(loss))
        if rate is not None:
            h.rate = None if rate == "none" else rate
        if loss is not None:
            h.loss = loss
        self._shape(h)
        self.save()

    def _shape(self, h: Host) -> None:
        ns = self.namespace(h.index)
        for where, dev in ((ns, "eth0"), (self.hub, f"h{h.index}")):
            subprocess.run(["ip", "netns", "exec", where, "tc", "qdisc", "del", "dev", dev,
                            "root"], capture_output=True)
            if h.rate is not None:
                netns.run("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev,
                          "root", "tbf", "rate", h.rate, "burst", netns.burst(h.rate),
                          "latency", "50ms")
        subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "troupe"],
                       capture_output=True)
        if h.loss > 0:
            per = int(round(h.loss * 100000))
            rules = ("table inet troupe {\n"
                     " chain in { type filter hook input priority 0; "
                     f"numgen random mod 100000 < {per} drop; }}\n"
                     " chain out { type filter hook output priority 0; "
                     f"numgen random mod 100000 < {per} drop; }}\n}}\n")
            netns.run("ip", "netns", "exec", ns, "nft", "-f", "-", stdin=rules)

    def set_cut(self, i: int, cut: bool) -> None:
        """Take host ``i``'s link down at the bridge (``cut``) or bring it back."""
        h = self.host(i)
        netns.ip("-n", self.hub, "link", "set", f"h{i}", "down" if cut else "up")
        h.cut = cut
        self.save()

    def tx_bytes(self, i: int) -> int:
        """Bytes host ``i`` has sent over its link (the veth's counter)."""
        return self._link_counter(i, "tx_bytes")

    def rx_bytes(self, i: int) -> int:
        """Bytes host ``i`` has received over its link (the veth's counter)."""
        return self._link_counter(i, "rx_bytes")

    def _link_counter(self, i: int, name: str) -> int:
        return int(netns.run("ip", "netns", "exec", self.namespace(i), "cat",
                             f"/sys/class/net/eth0/statistics/{name}"))

    # ---- processes ---------------------------------------------------------------------
    def _start_ray(self, h: Host) -> None:
        ray = str(Path(sys.executable).parent / "ray")
        common = ["--node-ip-address", h.address, "--num-cpus", f"{h.cpus:g}",
                  "--num-gpus", f"{h.gpus:g}", "--object-store-memory",
                  str(h.object_store_mb << 20), "--temp-dir", str(self.dir / f"ray-h{h.index}"),
                  "--disable-usage-stats", "--block"]
        if h.index == 0:
            argv = [ray, "start", "--head", "--port", str(RAY_PORT), "--dashboard-host",
                    h.address, "--dashboard-port", str(DASHBOARD_PORT), *common]
        else:
            argv = [ray, "start", "--address", self.address, *common]
        log = open(self.dir / f"ray-h{h.index}.log", "ab")
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(h.index), *argv],
                                env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        h.pid = proc.pid

    def kill(self, i: int) -> None:
        """Every process of host ``i`` killed at once, as a machine that loses power."""
        self.host(i)
        netns.kill_namespace(self.namespace(i))
        self.host(i).pid = None
        self.save()

    def restart(self, i: int) -> None:
        """Host ``i``'s Ray node started again (after ``kill``)."""
        h = self.host(i)
        netns.kill_namespace(self.namespace(i))
        self._start_ray(h)
        self.save()

    def exec(self, i: int, argv: list[str], **popen) -> subprocess.Popen:
        """``argv`` started in host ``i``'s namespace with the cluster's environment
        (RAY_ADDRESS, its token)."""
        self.host(i)
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(i), *argv],
                                env={**self.env(), **popen.pop("env", {})}, **popen)

    def run(self, i: int, argv: list[str], timeout_s: float = 300.0
            ) -> subprocess.CompletedProcess:
        """``exec`` and wait: the completed process, its output captured as text."""
        p = self.exec(i, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            raise HostsError(f"{' '.join(argv)[:80]} on host {i} ran past {timeout_s:g}s; "
                             f"its last output: {(out + err)[-400:]}") from None
        return subprocess.CompletedProcess(argv, p.returncode, out, err)

    def wait_nodes(self, n: int, timeout_s: float = 120.0) -> None:
        """Return once Ray counts ``n`` live nodes (HostsError after ``timeout_s``)."""
        probe = ("import ray, time\nray.init(address='auto', logging_level='ERROR')\n"
                 f"t = time.monotonic() + {timeout_s}\n"
                 f"while sum(x['Alive'] for x in ray.nodes()) != {n} and time.monotonic() < t:\n"
                 "    time.sleep(0.5)\n"
                 "print(sum(x['Alive'] for x in ray.nodes()))\n")
        deadline = time.monotonic() + timeout_s
        while True:
            p = self.run(0, [sys.executable, "-c", probe], timeout_s + 60)
            if p.returncode == 0 and p.stdout.strip() == str(n):
                return
            if time.monotonic() > deadline:
                raise HostsError(f"Ray counts {p.stdout.strip() or 'no'} live node(s) of {n} "
                                 f"after {timeout_s:g}s (logs in {self.dir}): "
                                 f"{p.stderr.strip().splitlines()[-1:] or ''}")
            time.sleep(1.0)

    def at(self, address: str) -> int:
        """The index of the host whose address is ``address``."""
        for h in self.hosts:
            if h.address == address:
                return h.index
        raise HostsError(f"no host has the address {address}")

    def find(self, text: str) -> list[int]:
        """The hosts running a process whose command line holds ``text`` (a Ray actor's is
        ``ray::<its class>``: ``find("ray::ServeReplica")``)."""
        found = []
        for h in self.hosts:
            for pid in netns.pids(self.namespace(h.index)):
                try:
                    line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:  # gone meanwhile
                    continue
                if text.encode() in line:
                    found.append(h.index)
                    break
        return found

    def host(self, i: int) -> Host:
        if not 0 <= i < len(self.hosts):
            raise HostsError(f"host {i}: the hosts are 0 to {len(self.hosts) - 1}")
        return self.hosts[i]

    def status(self) -> list[dict]:
        present = set(netns.namespaces())
        rows = []
        for h in self.hosts:
            ns = self.namespace(h.index)
            rows.append({"host": h.index, "namespace": ns, "address": h.address,
                         "up": ns in present, "link": "cut" if h.cut else "up",
                         "rate": h.rate or "unshaped", "loss": h.loss,
                         "processes": len(netns.pids(ns)) if ns in present else 0})
        return rows


# ---- the command -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="troupe hosts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="trh", help="the emulated cluster's name (default trh)")
    verbs = p.add_subparsers(dest="verb", required=True)
    up = verbs.add_parser("up", help="make the hosts and start Ray in them")
    up.add_argument("--hosts", type=int, default=3)
    up.add_argument("--rate", default=None, help="every link's rate (tbf), e.g. 1gbit")
    up.add_argument("--loss", type=float, default=0.0, help="share of packets dropped")
    up.add_argument("--delay", default=None, help="refused: this kernel has no netem")
    up.add_argument("--cpus", type=float, default=1.0, help="each host's Ray CPUs")
    up.add_argument("--head-cpus", type=float, default=None,
                    help="host 0's Ray CPUs, if not --cpus (0: the head runs no workers)")
    up.add_argument("--gpus", type=float, default=0.0, help="each host's logical GPUs")
    up.add_argument("--object-store-mb", type=int, default=256)
    verbs.add_parser("down", help="remove every namespace, link, rule and process")
    verbs.add_parser("status", help="the hosts, their links and processes, as JSON lines")
    shape = verbs.add_parser("shape", help="change a host's link while running")
    shape.add_argument("host", type=int)
    shape.add_argument("--rate", default=None, help="a rate, or none")
    shape.add_argument("--loss", type=float, default=None)
    shape.add_argument("--delay", default=None, help="refused: this kernel has no netem")
    for verb, text in (("cut", "take a host's link down"), ("restore", "bring it back"),
                       ("kill", "kill every process of a host"),
                       ("restart", "start a killed host's Ray node again")):
        verbs.add_parser(verb, help=text).add_argument("host", type=int)
    ex = verbs.add_parser("exec", help="run a command in a host (RAY_ADDRESS and the token set)")
    ex.add_argument("host", type=int)
    ex.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    try:
        return _verb(args)
    except HostsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _verb(args: argparse.Namespace) -> int:
    if args.verb == "up":
        check_tools(args.loss > 0, args.delay is not None)
        hosts = Hosts.up(args.hosts, args.name, args.rate, args.loss, args.cpus, args.gpus,
                         args.object_store_mb, head_cpus=args.head_cpus)
        print(f"{len(hosts.hosts)} hosts up: RAY_ADDRESS={hosts.address}, dashboard "
              f"{hosts.dashboard} (from host 0: troupe hosts exec 0 -- ...)")
        return 0
    if args.verb == "down":
        try:
            Hosts.load(args.name).down()
        except HostsError:  # nothing recorded: remove whatever carries the name
            for ns in netns.namespaces():
                if ns.startswith(f"{args.name}-h"):
                    netns.kill_namespace(ns)
                    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        return 0
    hosts = Hosts.load(args.name)
    if args.verb == "status":
        for row in hosts.status():
            print(json.dumps(row))
    elif args.verb == "shape":
        check_tools(bool(args.loss), args.delay is not None)
        hosts.shape(args.host, args.rate, args.loss)
    elif args.verb in ("cut", "restore"):
        hosts.set_cut(args.host, args.verb == "cut")
    elif args.verb == "kill":
        hosts.kill(args.host)
    elif args.verb == "restart":
        hosts.restart(args.host)
    elif args.verb == "exec":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            raise HostsError("exec: give the command after the host, e.g. exec 0 -- ray status")
        return hosts.exec(args.host, command).wait()
    return 0
