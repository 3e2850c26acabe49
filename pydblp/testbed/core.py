"""An emulated cluster on one machine: worker namespaces behind one switch.

Topology of a testbed ``NAME`` with N workers::

    netns NAME-w0          netns NAME-sw                      netns NAME-wK
    eth0 198.18.0.1/15 ─── w0 ┐                          ┌ wK ─── eth0 198.18.0.K+1/15
                              ├─ br0 (Linux bridge) ─────┤
                         fabric.bpf.c: native XDP on every switch port w0..wN-1;
                         known unicast leaves by XDP_REDIRECT to its egress port,
                         the bridge carries broadcast and unknown destinations

Everything is built with pyroute2 netlink.  Addresses come from 198.18.0.0/15
(RFC 2544 benchmarking) and exist only inside the testbed's namespaces; there
is no default route.  ARP entries are static (no ARP on the fabric), IPv6 is
off (no ND/MLD chatter in the counters), RPS is on for every veth (veth
reorders otherwise), and each worker NIC has a TBF rate limit (1 Gbit/s by
default: with XDP on the veths two vCPUs cannot keep up with raw veth speed,
docs/testbed.md).

A JSON state file per testbed (``/run/dblp/testbed/NAME.json``) is written
*before* anything is created, so ``down`` finds and removes everything a
creator made, even one killed with SIGKILL half way.

One module (~720 lines) because creation, the state file and teardown must
agree on every object's name and order; the fabric program's owner is
:mod:`pydblp.testbed.fabric`.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pydblp import bpf, host, net
from pydblp._libc import libc, pid_alive
from pydblp.cliutil import hold_stops
from pydblp.testbed import fabric as _fabric
from pydblp.testbed.fabric import Fabric, FabricError
from pydblp.transport import frames

STATE_DIR = Path(os.environ.get("DBLP_TESTBED_DIR", "/run/dblp/testbed"))
PIN_BASE = bpf.PIN_ROOT / "testbed"
DEFAULT_RATE = "1gbit"
SUBNET_PREFIX = 15               # 198.18.0.0/15
BROADCAST_ADDR = "198.19.255.255"  # the subnet's broadcast address: every worker (the fabric replicates)
BROADCAST_MAC = "ff:ff:ff:ff:ff:ff"
HOST_SYSCTLS = {"net.core.netdev_max_backlog": 10000}  # raised while any testbed is up
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")
MAX_WORKERS = 250
TBF_LATENCY_S = 0.05             # TBF queue: 50 ms at the rate
DELAY_BURST = 16 * 1024          # a delaying port's TBF: bytes it may pass at once (at least 4 frames) ...
DELAY_BURST_S = 4.0              # ... and at most this long at its rate (the kernel caps a TBF's at 2**32 ns)
NTF_MASTER, NUD_NOARP = 0x04, 0x40  # a bridge fdb entry: the bridge's, static
VETH_NATIVE_XDP_MAX_MTU = 3506   # veth native XDP for single-buffer programs (kernels before 5.18)

_live: set["Testbed"] = set()


class TestbedError(net.NetError):
    """A testbed cannot be built, found or used; the message says what to do."""

    __test__ = False  # not a pytest class


def worker_addr(i: int) -> str:
    n = i + 1
    return f"198.18.{n >> 8}.{n & 0xFF}"


def worker_mac(i: int) -> str:
    n = i + 1
    return f"02:db:00:00:{n >> 8:02x}:{n & 0xFF:02x}"


def _mac_bytes(mac: str) -> bytes:
    return bytes(int(x, 16) for x in mac.split(":"))


# ---- state files -------------------------------------------------------------

@contextlib.contextmanager
def _locked():
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(STATE_DIR / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _state_path(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


def _write_state(state: dict) -> None:
    path = _state_path(state["name"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


def read_state(name: str) -> dict:
    try:
        return json.loads(_state_path(name).read_text())
    except FileNotFoundError:
        raise TestbedError(f"no testbed {name!r} (see `dblp testbed status`)") from None
    except ValueError as e:  # (not JSON: a state file cut short)
        raise TestbedError(f"testbed {name!r}: its state file {_state_path(name)} is damaged ({e})") from None


def names() -> list[str]:
    """Names of every testbed with a state file (up, or left by a crashed creator)."""
    if not STATE_DIR.exists():
        return []
    return sorted(p.stem for p in STATE_DIR.glob("*.json"))


def resolve(name: str | None) -> str:
    """``name``, or the only testbed there is."""
    if name:
        read_state(name)
        return name
    found = names()
    if len(found) == 1:
        return found[0]
    if not found:
        raise TestbedError("no testbed is up (start one with `dblp testbed up`)")
    raise TestbedError(f"several testbeds are up ({', '.join(found)}): choose one with --name/--testbed")


# ---- host sysctls (shared by every testbed, restored by the last one down) ---------

def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


# One record for the whole host, whatever DBLP_TESTBED_DIR each testbed uses:
# the values found before the first testbed, and the state files of the
# testbeds holding them.  The last holder to go restores the values.
SYSCTL_RECORD = Path("/run/dblp/host-sysctl.json")


@contextlib.contextmanager
def _sysctl_locked():
    SYSCTL_RECORD.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(SYSCTL_RECORD.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            rec = json.loads(SYSCTL_RECORD.read_text())
        except (OSError, ValueError):
            rec = {"saved": {}, "holders": []}
        yield rec
        if rec["holders"]:
            SYSCTL_RECORD.write_text(json.dumps(rec))
        else:
            SYSCTL_RECORD.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _raise_host_sysctls(holder: Path) -> None:
    """Record (first holder only) and raise the host sysctls; ``holder`` is a state file."""
    with _sysctl_locked() as rec:
        rec["holders"] = [h for h in rec["holders"] if Path(h).exists()]
        if not rec["holders"]:
            rec["saved"] = {}
            for key in HOST_SYSCTLS:
                try:
                    rec["saved"][key] = _sysctl_path(key).read_text().strip()
                except OSError:
                    pass
        rec["holders"].append(str(holder.resolve()))
        for key, want in HOST_SYSCTLS.items():
            try:
                if int(_sysctl_path(key).read_text()) < want:
                    _sysctl_path(key).write_text(str(want))
            except (OSError, ValueError):
                pass


def _restore_host_sysctls() -> None:
    """Drop holders whose state file is gone; the last one out restores the saved values."""
    with _sysctl_locked() as rec:
        rec["holders"] = [h for h in rec["holders"] if Path(h).exists()]
        if rec["holders"]:
            return
        for key, val in rec.get("saved", {}).items():
            try:
                _sysctl_path(key).write_text(str(val))
            except OSError:
                pass


# ---- namespace helpers ---------------------------------------------------------

CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18


def _ns_sysctl(ns: str, key: str, value) -> None:
    """Write a per-netns sysctl (``/proc/sys/net`` follows the thread's netns)."""
    with net.in_netns(ns):
        _sysctl_path(key).write_text(str(value))


def _ethtool_set(ns: str, ifname: str, cmd: int, value: int, what: str) -> None:
    try:
        net.ethtool_value(ifname, cmd, value, ns)
    except OSError as e:
        raise TestbedError(f"cannot turn {what} for {ifname} in {ns}: {e.strerror} (the fabric forwards "
                           "with XDP_REDIRECT, which needs it)") from None


def _worker_nic_features(ns: str, ifname: str) -> None:
    """Make a worker NIC a target the fabric can forward to with XDP_REDIRECT.

    GRO on: a veth then runs NAPI without an XDP program of its own, which
    ndo_xdp_xmit needs.  Transmit checksum offload off: a redirected frame
    leaves the skb behind, and with it the 'checksum still to be filled in'
    mark a veth would otherwise carry to the receiver, so the sender's stack
    computes TCP/UDP checksums itself (as with a NIC without offload).
    """
    _ethtool_set(ns, ifname, net.ETHTOOL_STXCSUM, 0, "transmit checksum offload off")
    _ethtool_set(ns, ifname, net.ETHTOOL_SGRO, 1, "GRO on")


def _set_rps(ns: str, ifnames: list[str], mask: str) -> None:
    """Enable RPS on ``ifnames`` of ``ns``: sysfs of that netns, in a forked child.

    /sys/class/net shows the devices of the netns that mounted sysfs, so the
    child unshares its mount namespace, enters ``ns`` and mounts a fresh sysfs.
    """
    pid = os.fork()
    if pid == 0:  # child: syscalls only, then _exit
        code = 1
        try:
            if libc.unshare(CLONE_NEWNS) == 0 and \
                    libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0:
                fd = os.open(os.path.join(net.NETNS_RUN_DIR, ns), os.O_RDONLY)
                if libc.setns(fd, net.CLONE_NEWNET) == 0 and \
                        libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None) == 0:
                    code = 0
                    for ifn in ifnames:
                        for q in Path(f"/sys/class/net/{ifn}/queues").glob("rx-*"):
                            try:
                                (q / "rps_cpus").write_text(mask)
                            except OSError:
                                code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    # RPS is a performance aid: a failure is tolerated (counted in the state)
    return os.waitstatus_to_exitcode(status) == 0


def _ns_pids(ns: str) -> list[int]:
    """Processes whose network namespace is ``ns`` (like `ip netns pids`)."""
    try:
        st = os.stat(os.path.join(net.NETNS_RUN_DIR, ns))
    except FileNotFoundError:
        return []
    me = os.getpid()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            s = os.stat(f"/proc/{d}/ns/net")
        except OSError:
            continue
        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
            out.append(int(d))
    return out


def _kill_ns_processes(namespaces: list[str], grace: float = 1.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process left inside the testbed's namespaces.

    They would otherwise keep the namespaces (their veths, XDP attachments and
    fabric program) alive after the names are gone.
    """
    pids = [p for ns in namespaces for p in _ns_pids(ns)]
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if pid_alive(p) and not _reap(p)]
        time.sleep(0.02)
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
            _reap(p)
    return pids


def _reap(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return False


def teardown(name: str) -> dict:
    """Remove everything testbed ``name`` made (per its state file); idempotent.

    Returns what was found: ``{'namespaces': [...], 'killed': [...], 'pins': bool}``.
    """
    with _locked():
        try:
            state = read_state(name)
        except TestbedError:  # no state file (nothing known), or a damaged one (its namespaces by name)
            damaged = _state_path(name).exists()
            state = {"name": name, "pin_dir": str(PIN_BASE / name),
                     "namespaces": [n for n in net.netns_list() if n.startswith(name + "-")] if damaged else []}
        maker = state.get("creator_pid") or 0
        if state.get("status") == "creating" and maker > 0 and maker != os.getpid() and pid_alive(maker):
            raise TestbedError(f"testbed {name!r} is still being created by pid {maker}: run `dblp testbed "
                               f"down --name {name}` once it is up (or once that process has ended)")
        spaces = state.get("namespaces", [])
        killed = _kill_ns_processes(spaces)
        sw = state.get("switch_ns")
        if sw and net.netns_exists(sw):
            for port in state.get("ports", {}):
                with contextlib.suppress(Exception):
                    net.xdp_detach(port, netns=sw)
        gone, failed = [], []
        for ns in spaces:  # (each on its own: one that fails leaves the rest to go)
            try:
                if net.netns_exists(ns):
                    net.netns_del(ns)
                    gone.append(ns)
            except (OSError, net.NetError) as e:
                failed.append(f"namespace {ns}: {e}")
        for ns in spaces:  # (job claims a killed data plane left on a program pinned inside)
            shutil.rmtree(host.CLAIM_DIR / ns, ignore_errors=True)
        pin = Path(state.get("pin_dir") or PIN_BASE / name)
        had_pins = pin.exists()
        for p in [pin, *(bpf.PIN_ROOT / "host" / ns for ns in spaces)]:  # (and host programs loaded inside)
            try:
                bpf.unpin(p)
            except OSError as e:
                failed.append(f"pins {p}: {e}")
        if failed:  # the state file stays: `down` again retries what is left
            raise TestbedError(f"testbed {name!r}: not all gone ({'; '.join(failed)}): run `dblp testbed down "
                               f"--name {name}` again")
        _state_path(name).unlink(missing_ok=True)
        _restore_host_sysctls()
    return {"namespaces": gone, "killed": killed, "pins": had_pins}


def teardown_all() -> list[str]:
    """``down --all``: every testbed with a state file, plus orphaned pin dirs."""
    done, failed = [], []
    for n in names():  # (each on its own: one that fails leaves the others to go)
        try:
            teardown(n)
            done.append(n)
        except TestbedError as e:
            failed.append(str(e))
    if PIN_BASE.exists():
        for d in PIN_BASE.iterdir():
            # orphan: no state file here and no namespace (a testbed of another state dir is live)
            if d.is_dir() and not _state_path(d.name).exists() and not net.netns_exists(f"{d.name}-sw"):
                bpf.unpin(d)
                done.append(d.name)
    _restore_host_sysctls()
    if failed:
        raise TestbedError("; ".join(failed))
    return done


def _worker_index(worker, n: int) -> int:
    if isinstance(worker, int):
        i = worker
    else:
        s = str(worker)
        s = s[1:] if s[:1] == "w" else s
        if not s.isdigit():
            raise TestbedError(f"bad worker {worker!r}: use w0..w{n - 1} or an index")
        i = int(s)
    if not 0 <= i < n:
        raise TestbedError(f"no worker {worker!r}: the testbed has w0..w{n - 1}")
    return i


# ---- the testbed -------------------------------------------------------------

class Testbed:
    """An emulated cluster; a context manager that removes everything on exit.

    >>> with Testbed(workers=4) as tb:
    ...     tb.burst(ratio=0.8, duration=0.05)
    ...     tb.run("w1", ["ping", "-c1", tb.addr("w0")])

    ``rate``: each worker NIC's TBF limit ('1gbit' by default, ``0``/'none' for
    none).  ``mode``: the fabric's XDP mode; ``auto`` is native (at any MTU
    where the kernel has multi-buffer XDP, 5.18+; else up to MTU 3506, veth's
    limit for single-buffer XDP, and generic (skb) above).  ``fabric=False`` skips the XDP fabric (no faults possible).
    ``prog``: an already compiled ``(bcc.BPF, fn)`` to share (tests).
    ``queues``: receive and transmit queues of every veth (both ends of each
    link), as a multi-queue NIC has; 1 by default.
    """

    __test__ = False

    def __init__(self, workers: int = 4, name: str | None = None, mtu: int = 1500,
                 rate: str | int | None = None, *, fabric: bool = True, mode: str = "auto",
                 rps: bool = True, prog=None, queues: int = 1):
        if not 1 <= int(workers) <= MAX_WORKERS:
            raise TestbedError(f"workers must be within 1..{MAX_WORKERS}, got {workers}")
        if name is not None and not NAME_RE.match(name):
            raise TestbedError(f"bad testbed name {name!r}: letters, digits, '_.-', at most 32")
        if not 68 <= int(mtu) <= 65535:
            raise TestbedError(f"mtu must be within 68..65535, got {mtu}")
        self.n = int(workers)
        if isinstance(queues, bool) or not isinstance(queues, int) or not 1 <= queues <= 64:
            raise TestbedError(f"queues must be within 1..64 (per veth), got {queues!r}")
        self.queues = queues
        self.name = name or f"tb{secrets.token_hex(3)}"
        self.mtu = int(mtu)
        try:
            self.rate_bps = _fabric.parse_rate(DEFAULT_RATE if rate is None else rate)
        except FabricError as e:
            raise TestbedError(str(e)) from None
        if self.rate_bps and self.rate_bps // 8 >= 1 << 32:
            raise TestbedError("rate above ~34 Gbit/s is not supported by the TBF limit; use 0 for none")
        self.use_fabric = fabric
        native_ok = self.mtu <= VETH_NATIVE_XDP_MAX_MTU or not fabric or bpf.xdp_frags_supported()
        if mode == "auto":
            mode = "native" if native_ok else "skb"
        if mode not in ("native", "skb"):
            raise TestbedError(f"bad fabric mode {mode!r}: auto, native or skb")
        if mode == "native" and not native_ok:
            raise TestbedError(f"native XDP on veth above mtu {VETH_NATIVE_XDP_MAX_MTU} (got {self.mtu}) needs "
                               "multi-buffer XDP (kernel 5.18+); use mode skb (or auto)")
        self.mode = mode
        self.rps = rps
        self._prog = prog
        self.state: dict = {}
        self._fab: Fabric | None = None
        self._procs: list[subprocess.Popen] = []
        self._owner = False
        self._pid = os.getpid()

    # ---- naming -------------------------------------------------------
    @property
    def switch_ns(self) -> str:
        return f"{self.name}-sw"

    @property
    def workers(self) -> list[str]:
        return [f"w{i}" for i in range(self.n)]

    def ns(self, worker) -> str:
        """The network namespace of ``worker`` ('w2', 2)."""
        return f"{self.name}-w{_worker_index(worker, self.n)}"

    def addr(self, worker) -> str:
        """IPv4 address of ``worker`` (198.18.0.0/15)."""
        return worker_addr(_worker_index(worker, self.n))

    @property
    def addrs(self) -> dict[str, str]:
        """Worker name -> IPv4 address."""
        return {w: worker_addr(i) for i, w in enumerate(self.workers)}

    def mac(self, worker) -> str:
        return worker_mac(_worker_index(worker, self.n))

    def group(self, port: int) -> tuple[str, int, str]:
        """``(address, port, mac)`` that reaches every worker on UDP ``port`` at once (the subnet's
        broadcast address): ``Collective``'s ``group`` for a broadcast all-gather."""
        return (BROADCAST_ADDR, port, BROADCAST_MAC)

    @property
    def ports(self) -> dict[str, int]:
        """Switch port name (w0...) -> its ifindex in the switch namespace."""
        return dict(self.state.get("ports", {}))

    @property
    def prog_id(self) -> int | None:
        return self.state.get("prog_id")

    # ---- lifecycle ----------------------------------------------------
    @classmethod
    def open(cls, name: str | None = None) -> "Testbed":
        """Attach to a testbed another process brought up (``dblp testbed up``).

        The testbed stays that process's: leaving ``with Testbed.open(...)``
        releases only what this process opened (:meth:`close`); :meth:`down`
        removes the testbed itself.
        """
        state = read_state(resolve(name))
        tb = cls(workers=state["workers"], name=state["name"], mtu=state["mtu"],
                 rate=state.get("rate_bps", 0), fabric=state.get("fabric", True), queues=state.get("queues", 1))
        tb.state = state
        return tb

    def __enter__(self) -> "Testbed":
        if not self.state:
            self.up()
        return self

    def __exit__(self, *exc) -> None:
        if self._owner:
            self.down()
        else:
            self.close()

    def up(self) -> "Testbed":
        spaces = [self.switch_ns] + [self.ns(i) for i in range(self.n)]
        with _locked():
            if _state_path(self.name).exists():
                raise TestbedError(f"testbed {self.name!r} exists already (`dblp testbed down --name "
                                   f"{self.name}` removes it)")
            clash = [s for s in spaces if net.netns_exists(s)]
            if clash:
                raise TestbedError(f"namespace {clash[0]} exists already: choose another name")
            self.state = {
                "name": self.name, "status": "creating", "creator_pid": os.getpid(),
                "created": time.time(), "workers": self.n, "mtu": self.mtu,
                "rate_bps": self.rate_bps, "fabric": self.use_fabric, "mode": self.mode, "queues": self.queues,
                "switch_ns": self.switch_ns, "namespaces": spaces,
                "pin_dir": str(PIN_BASE / self.name),
                "addrs": {f"w{i}": worker_addr(i) for i in range(self.n)},
                "macs": {f"w{i}": worker_mac(i) for i in range(self.n)},
                "ports": {}, "prog_id": None,
            }
            _write_state(self.state)
            _raise_host_sysctls(_state_path(self.name))
        self._owner = True
        self._pid = os.getpid()
        _live.add(self)
        try:
            self._build(spaces)
        except BaseException:
            self.down()
            raise
        self.state["status"] = "up"
        _write_state(self.state)
        return self

    def _build(self, spaces: list[str]) -> None:
        for ns in spaces:
            net.netns_add(ns)
            # no IPv6 chatter (ND, MLD) on the fabric; must precede link creation
            for key in ("net.ipv6.conf.all.disable_ipv6", "net.ipv6.conf.default.disable_ipv6"):
                with contextlib.suppress(OSError):
                    _ns_sysctl(ns, key, 1)
        sw = self.switch_ns
        ports = {}
        with net.ipr(sw) as ip:
            ip.link("set", index=ip.link_lookup(ifname="lo")[0], state="up")
            ip.link("add", ifname="br0", kind="bridge", br_forward_delay=0, br_stp_state=0)
            br = ip.link_lookup(ifname="br0")[0]
            for i in range(self.n):
                port = f"w{i}"
                qs = {"num_tx_queues": self.queues, "num_rx_queues": self.queues}
                ip.link("add", ifname=port, kind="veth", **qs,
                        peer={"ifname": "eth0", "net_ns_fd": self.ns(i), "address": worker_mac(i), **qs})
                idx = ip.link_lookup(ifname=port)[0]
                ip.link("set", index=idx, mtu=self.mtu, master=br)
                # the bridge knows every worker (no flooding of what the fabric passes up to it)
                ip.fdb("add", ifindex=idx, lladdr=worker_mac(i), flags=NTF_MASTER, state=NUD_NOARP)
                ports[port] = idx
            ip.link("set", index=br, mtu=self.mtu, state="up")
        self.state["ports"] = ports
        _write_state(self.state)
        for i in range(self.n):
            with net.ipr(self.ns(i)) as ip:
                ip.link("set", index=ip.link_lookup(ifname="lo")[0], state="up")
                eth = ip.link_lookup(ifname="eth0")[0]
                ip.link("set", index=eth, mtu=self.mtu)
                ip.addr("add", index=eth, address=worker_addr(i), prefixlen=SUBNET_PREFIX)
                for j in range(self.n):
                    if j != i:
                        ip.neigh("add", dst=worker_addr(j), lladdr=worker_mac(j), ifindex=eth,
                                 state=0x80)  # NUD_PERMANENT
                if self.rate_bps:
                    rate = self.rate_bps // 8
                    burst = max(self.mtu * 4, rate // 1000)  # ~1 ms of tokens, >= 4 frames
                    ip.tc("add", "tbf", eth, 0x10000, rate=rate, burst=burst,
                          latency=int(TBF_LATENCY_S * 1e6))
                ip.link("set", index=eth, state="up")
            _worker_nic_features(self.ns(i), "eth0")
        if self.rps:
            mask = format((1 << (os.cpu_count() or 1)) - 1, "x")
            ok = _set_rps(sw, list(ports), mask)
            for i in range(self.n):
                ok = _set_rps(self.ns(i), ["eth0"], mask) and ok
            self.state["rps"] = mask if ok else None
        if self.use_fabric:
            macs = {f"w{i}": _mac_bytes(worker_mac(i)) for i in range(self.n)}
            self.state["prog_id"] = _fabric.load(Path(self.state["pin_dir"]), sw, ports, macs,
                                                 mode=self.mode, prog=self._prog)
        with net.ipr(sw) as ip:
            for idx in ports.values():
                ip.link("set", index=idx, state="up")

    def detach(self) -> "Testbed":
        """Leave the testbed up after this process exits (``dblp testbed up``)."""
        _live.discard(self)
        self._owner = False
        return self

    def ping(self, src, dst, count: int = 1, timeout: float = 1.0, size: int = 56) -> int:
        """ICMP echo from worker ``src`` to worker ``dst`` (an address or worker); replies received."""
        return ping(self.ns(src), dst if "." in str(dst) else self.addr(dst), count, timeout, size)

    def close(self) -> None:
        """Release what this process opened (the commands :meth:`popen` started, the fabric's
        maps) and leave the testbed up; idempotent."""
        if os.getpid() != self._pid:
            return  # a forked child (pyroute2 forks for netns): the parent's handles are its own
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                with contextlib.suppress(Exception):
                    p.wait(timeout=5)
        self._procs.clear()
        if self._fab:
            self._fab.close()
            self._fab = None

    def down(self) -> None:
        """Remove the testbed (namespaces, links, XDP, pins, state file); idempotent."""
        if os.getpid() != self._pid:
            return  # a forked child (pyroute2 forks for netns): never tear down the parent's
        self.close()
        if self.state:
            teardown(self.name)
            self.state = {}
        _live.discard(self)

    # ---- faults -------------------------------------------------------
    @property
    def fabric(self) -> Fabric:
        if not self.state.get("fabric", self.use_fabric):
            raise TestbedError(f"testbed {self.name} runs without the fabric: no faults")
        if self._fab is None:
            gone = _fabric_detached(self.state)
            if gone:
                raise TestbedError(f"testbed {self.name}: its fabric program is not attached on "
                                   f"{', '.join(gone)} (replaced, e.g. by `dblp load --force`): faults "
                                   f"would change nothing there; `dblp testbed down --name {self.name}` "
                                   f"and up again")
            self._fab = Fabric(Path(self.state["pin_dir"]), self.ports)
        return self._fab

    def loss(self, p: float, port=None) -> None:
        self.fabric.loss(p, port=port)

    def ge(self, p: float, r: float, loss_bad: float = 1.0, loss_good: float = 0.0, port=None) -> None:
        self.fabric.ge(p, r, loss_bad=loss_bad, loss_good=loss_good, port=port)

    def burst(self, ratio: float = 0.8, duration: float = 0.05, *, at: float | None = None,
              delay: float = 0.0, every: float | None = None, count: int | None = None,
              port=None) -> float:
        return self.fabric.burst(ratio=ratio, duration=duration, at=at, delay=delay,
                                 every=every, count=count, port=port)

    def queue(self, rate, buffer=256 * 1024, thresholds=None, port=None, mark=None,
              mark_drop: bool = False, delay: bool = False) -> None:
        """:meth:`Fabric.queue` on ``port`` (every port if None).

        Args:
            mark: CE-mark ECN-capable frames admitted past this backlog (bytes or '32k').
            mark_drop: past ``mark``, drop the IP frames that cannot be marked (Not-ECT), as an
                ECN AQM does; off, they meet only the tail drop at ``buffer``.
            delay: the queue also holds frames, as a switch's buffer does: a TBF draining at
                ``rate`` with room for ``buffer`` (and two frames) on the switch-side port, to
                which the fabric hands what its virtual queue admits through the bridge.  The
                virtual queue still decides marks and drops, shadowing the TBF's backlog; frames
                of a broadcast all-gather are not delayed.  Off (the default), frames are
                forwarded by XDP and never wait: loss and marks only.
        """
        bits, size = _fabric.parse_rate(rate), _fabric.parse_size(buffer)
        if delay and bits:
            self._delay_burst(bits // 8)  # refused before anything changes
        self.fabric.queue(rate, buffer=buffer, thresholds=thresholds, port=port, mark=mark, mark_drop=mark_drop,
                          delay=delay)
        for idx in self.fabric._ifindexes(port):
            self._delay_qdisc(idx, bits // 8 if delay else 0, size)

    def clear(self, port=None) -> None:
        self.fabric.clear(port=port)
        for idx in self.fabric._ifindexes(port):
            self._delay_qdisc(idx, 0, 0)

    def _delay_qdisc(self, idx: int, rate: int, buffer: int) -> None:
        """A TBF of ``rate`` bytes/s holding ``buffer`` bytes on switch port ``idx``; 0: none."""
        frame = self.mtu + 14
        with net.ipr(self.switch_ns) as ip:
            if rate:
                ip.tc("replace", "tbf", idx, 0x10000, rate=rate, burst=self._delay_burst(rate),
                      limit=buffer + 2 * frame)
                return
            try:
                ip.tc("del", index=idx, root=True)
            except Exception as e:  # pyroute2's NetlinkError carries the errno in .code
                if getattr(e, "code", None) not in (errno.ENOENT, errno.EINVAL):  # none there
                    raise

    def _delay_burst(self, rate: int) -> int:
        """Bytes a delaying queue of ``rate`` bytes/s passes at once: DELAY_BURST (4 frames at
        least), at most DELAY_BURST_S of the rate; a TestbedError if that is not one frame."""
        frame = self.mtu + 14
        burst = min(max(DELAY_BURST, 4 * frame), int(rate * DELAY_BURST_S))
        if burst < frame:
            raise TestbedError(f"a delaying queue at {rate * 8} bit/s cannot pass a {frame}-byte frame: "
                               f"use a rate of {frame * 8 / DELAY_BURST_S:.0f} bit/s or more")
        return burst

    def delay_stats(self, port) -> dict:
        """The delaying qdisc on ``port`` (:meth:`queue` with ``delay``): ``packets`` and ``bytes``
        it sent, ``drops``, ``backlog`` bytes now; {} when the port has none."""
        (idx,) = self.fabric._ifindexes(port)
        with net.ipr(self.switch_ns) as ip:
            for q in ip.get_qdiscs(index=idx):
                if q.get_attr("TCA_KIND") != "tbf":
                    continue
                st = q.get_attr("TCA_STATS2")
                basic, queue = st.get_attr("TCA_STATS_BASIC"), st.get_attr("TCA_STATS_QUEUE")
                return {"packets": basic["packets"], "bytes": basic["bytes"], "drops": queue["drops"],
                        "backlog": queue["backlog"]}
        return {}

    def stats(self, reset: bool = False) -> dict:
        return self.fabric.stats(reset=reset)

    # ---- processes ----------------------------------------------------
    def argv(self, worker, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run inside ``worker``'s netns (setns only: /sys and bpffs stay visible)."""
        path = os.path.join(net.NETNS_RUN_DIR, self.ns(worker))
        if shutil.which("nsenter"):
            return ["nsenter", f"--net={path}", "--", *argv]
        return [sys.executable, "-m", "pydblp.testbed.nsexec", path, *argv]

    def popen(self, worker, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` in ``worker``; killed at :meth:`down` if still running."""
        p = subprocess.Popen(self.argv(worker, argv), **kw)
        self._procs.append(p)
        return p

    def run(self, worker, argv: list[str], check: bool = False, timeout: float | None = 60,
            **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` in ``worker`` to completion (``subprocess.run`` keywords apply)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(worker, argv), check=check, timeout=timeout, **kw)


def _icmp_sum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(int.from_bytes(b[i:i + 2], "big") for i in range(0, len(b), 2))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


def ping(ns: str, addr: str, count: int = 1, timeout: float = 1.0, size: int = 56) -> int:
    """ICMP echo from inside netns ``ns`` to ``addr`` (no ping binary needed); replies received."""
    import socket
    import struct

    with net.in_netns(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    got = 0
    try:
        ident = os.getpid() & 0xFFFF
        for seq in range(count):
            body = struct.pack("!d", time.monotonic()).ljust(size, b"\xa5")
            hdr = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
            pkt = struct.pack("!BBHHH", 8, 0, frames.checksum(hdr + body), ident, seq) + body
            s.sendto(pkt, (addr, 0))
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                s.settimeout(left)
                try:
                    data, _ = s.recvfrom(65535)
                except (TimeoutError, OSError):
                    break
                ihl = (data[0] & 0xF) * 4
                typ, _, _, rid, rseq = struct.unpack_from("!BBHHH", data, ihl)
                if typ == 0 and rid == ident and rseq == seq:
                    got += 1
                    break
    finally:
        s.close()
    return got


@atexit.register
def _down_live() -> None:
    """A creator exiting without ``with`` (or ``down``) still takes its testbeds down, and no
    Ctrl-C or SIGTERM while it does can leave them half gone: the process is ending anyway."""
    mine = [tb for tb in list(_live) if tb._pid == os.getpid()]
    if mine:
        hold_stops()
    for tb in mine:
        with contextlib.suppress(Exception):
            tb.down()


def status() -> list[dict]:
    """One entry per testbed: state, whether its namespaces exist, creator alive."""
    out = []
    for n in names():
        try:
            st = read_state(n)
        except (TestbedError, ValueError):
            continue
        present = [s for s in st.get("namespaces", []) if net.netns_exists(s)]
        st["present"] = len(present) == len(st.get("namespaces", [])) and bool(present)
        st["creator_alive"] = (st.get("creator_pid") or 0) > 0 and pid_alive(st["creator_pid"])
        if st.get("prog_id"):
            st["fabric_loaded"] = _fabric.prog_exists(st["prog_id"])
            st["fabric_detached"] = st["present"] and _fabric_detached(st)
        out.append(st)
    return out


def _fabric_detached(state: dict) -> list[str]:
    """The switch ports of a testbed (its state) where its fabric program is not the one
    attached (another program replaced it, ``dblp load --force``, or none is there)."""
    out = []
    for port in state.get("ports", {}):
        try:
            got = net.xdp_query(port, state.get("switch_ns"))
        except (net.NetError, OSError, IndexError):
            got = None
        if not got or got.get("prog_id") != state.get("prog_id"):
            out.append(port)
    return out
