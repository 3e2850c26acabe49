"""Crash hygiene (issue #42): a rank SIGKILLed mid-round, then the operator's clean-up.

One testbed per data-plane kind, three ranks, one process each in its worker's namespace
(``tb.popen``), running exact allreduce rounds of 2M floats back to back.  Once rounds flow,
rank 2's process is SIGKILLed (by its pid):

* the survivors each leave their round with one ``CollectiveError`` line naming the dead rank
  ("rank 2 sent nothing for 3.0 s ...", or, from a survivor that finished that round, among the
  ranks silent as long in the next), within ``peer_timeout`` (never a hang, never another
  exception), and close their data planes;
* the killed rank could not clean up, and needs not: its host XDP program was attached through
  a BPF link, which the kernel released with the process, as it did its socket and UMEM. No
  pydblp program is left on any worker NIC and none in the kernel; `dblp status` lists none,
  and `dblp unload --all` finds nothing to do;
* `dblp testbed down --name NAME` leaves none of the testbed's namespaces.

`dblp unload --all` clears every pydblp attachment on the host, by design (as in
tests/linux/test_host_netns.py): run this module alone, not beside other privileged tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pydblp import bpf, host, net
from pydblp.testbed import Testbed, core
from tests.helpers import unique_name

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
WORLD = 3
KILLED = 2
PEER_TIMEOUT = 3.0
EXIT_MARGIN = 10.0      # s past peer_timeout a survivor may take to exit (a slow 2-core CI machine)
N = 2 << 20             # floats per tensor: 8 MB, ~6000 chunks, a round lasts long enough to kill inside it
ROUNDS = 60             # bound: the ranks stop by themselves even if nothing kills them
JOB = 42
COLLECTIVE_ERROR = 3    # a worker's exit code after a CollectiveError

RANK = r"""
import os, sys, time
import numpy as np
from pydblp.collective import Collective, CollectiveError, Config
from pydblp.dataplane import open_dataplane

rank, world, kind, job = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
peer_timeout, n, rounds = float(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
addrs, macs = sys.argv[8].split(","), sys.argv[9].split(",")
dp = open_dataplane(kind, "eth0", job=job, rank=rank, world=world)
col, code = None, 1
try:
    peers = [(a, dp.endpoint.port, m) for a, m in zip(addrs, macs)]
    col = Collective(dp.transport, rank, world, peers, Config(job=job, peer_timeout=peer_timeout))
    print(f"ready {rank} pid {os.getpid()}", flush=True)
    if sys.stdin.readline().strip() == "go":
        x = np.full(n, float(rank + 1), np.float32)
        want = np.float32(sum(range(1, world + 1)) / world)
        last = time.monotonic()
        for i in range(rounds):
            try:
                y = col.allreduce(x)
            except CollectiveError as e:
                print(f"error: {time.monotonic() - last:.2f} s after the last good round: {e}", flush=True)
                code = 3
                break
            last = time.monotonic()
            print(f"round {i} exact {bool((y == want).all())} at {time.monotonic():.3f}", flush=True)
        else:
            print("done", flush=True)
            code = 0
finally:
    if col is not None:
        col.close()
    dp.close()
sys.exit(code)
"""


class Worker:
    """One rank's process: its output lines, collected by a thread as they come."""

    def __init__(self, tb, rank: int, kind: str):
        argv = [sys.executable, "-c", RANK, str(rank), str(WORLD), kind, str(JOB), str(PEER_TIMEOUT), str(N),
                str(ROUNDS), ",".join(tb.addr(r) for r in range(WORLD)), ",".join(tb.mac(r) for r in range(WORLD))]
        self.rank = rank
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.p = tb.popen(rank, argv, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.p.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.lines.append("<eof>")
            self.cond.notify_all()

    @property
    def out(self) -> str:
        with self.cond:
            return "\n".join(self.lines)

    def wait_for(self, pred, timeout: float, what: str) -> None:
        """Until ``pred(lines)`` holds; fails the test with the output after ``timeout`` s or at EOF."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not pred(self.lines):
                left = deadline - time.monotonic()
                if left <= 0 or (self.lines and self.lines[-1] == "<eof>"):
                    pytest.fail(f"rank {self.rank}: {what} (waited {timeout:.0f} s): {self.out[-3000:]}")
                self.cond.wait(left)

    def rounds(self) -> int:
        with self.cond:
            return sum(line.startswith("round ") for line in self.lines)

    def go(self) -> None:
        self.p.stdin.write("go\n")
        self.p.stdin.flush()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.reader.join(timeout=5)


def dblp(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pydblp.cli", *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def xdp_sockets(ns: str) -> int:
    """AF_XDP sockets open in netns ``ns`` (the XDP row of /proc/net/protocols, counted per netns)."""
    with net.in_netns(ns):
        text = Path("/proc/thread-self/net/protocols").read_text()
    for line in text.splitlines():
        f = line.split()
        if f and f[0] == "XDP":
            return int(f[2])
    pytest.fail("this kernel lists no XDP row in /proc/net/protocols (CONFIG_XDP_SOCKETS=n?)")


def pins() -> set[Path]:
    root = bpf.PIN_ROOT / "host"
    return set(root.rglob("*")) if root.exists() else set()


def prog_gone(prog_id: int, timeout: float = 10.0) -> bool:
    """The kernel freed program ``prog_id`` (freeing is asynchronous after the last reference goes)."""
    deadline = time.monotonic() + timeout
    while bpf.prog_info_by_id(prog_id) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("kind", ["xsk", "xsk-ktx", "udp"])
def test_sigkill_mid_round_then_unload_all_and_down(bpf_xdp, kind):
    af_xdp = kind != "udp"
    name = unique_name("ch")
    # `dblp unload --all` below removes every pydblp attachment on the host: never another run's
    others = host.loaded()
    if others:
        pytest.skip("pydblp is attached elsewhere on this host ("
                    + ", ".join(f"{e['ifname']}@{e['netns'] or '-'}" for e in others[:4])
                    + "): this test ends with `dblp unload --all`, which would remove it; run it alone")
    pins_before = pins()
    tb = Testbed(workers=WORLD, name=name, rate=0, fabric=False)
    workers: list[Worker] = []
    try:
        tb.up()
        spaces = [tb.ns(r) for r in range(WORLD)]
        workers = [Worker(tb, r, kind) for r in range(WORLD)]
        for w in workers:  # each compiles and attaches the host program (AF_XDP kinds): seconds on 2 cores
            w.wait_for(lambda ls: any(x.startswith("ready ") for x in ls), 60, "no ready line")
        for r in range(WORLD):
            q = host.attached_program("eth0", tb.ns(r))
            assert (q is not None and q["name"] == host.PROG_NAME) == af_xdp, (r, q)
            assert xdp_sockets(tb.ns(r)) == (1 if af_xdp else 0)
        prog_id = host.attached_program("eth0", tb.ns(KILLED))["prog_id"] if af_xdp else None
        for w in workers:
            w.go()
        # rounds flow: every rank finished two (exact: Config's default phase tolerates no loss)
        for w in workers:
            w.wait_for(lambda ls: sum(x.startswith("round ") for x in ls) >= 2, 60, "no two rounds")
        victim = workers[KILLED]
        # rounds run back to back, so rank 2 is inside one now; half a round more to be well inside it
        t0 = time.monotonic()
        n0 = victim.rounds()
        victim.wait_for(lambda ls: sum(x.startswith("round ") for x in ls) > n0, 60, "no next round")
        time.sleep((time.monotonic() - t0) / 2)
        assert victim.p.poll() is None, victim.out[-3000:]
        done = victim.rounds()
        t_kill = time.monotonic()
        os.kill(victim.p.pid, signal.SIGKILL)
        assert victim.p.wait(timeout=10) == -signal.SIGKILL

        # the survivors: a clear error naming rank 2 within peer_timeout, no hang
        for w in workers[:KILLED]:
            try:
                rc = w.p.wait(timeout=max(0.0, t_kill + PEER_TIMEOUT + EXIT_MARGIN - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {w.rank} hung {PEER_TIMEOUT + EXIT_MARGIN:.0f} s after rank {KILLED} "
                            f"was killed: {w.out[-3000:]}")
            waited = time.monotonic() - t_kill
            w.reader.join(timeout=5)
            out = w.out
            assert rc == COLLECTIVE_ERROR and "Traceback" not in out, out[-3000:]
            errors = [x for x in w.lines if x.startswith("error: ")]
            assert len(errors) == 1, out[-3000:]
            m = re.match(r"error: ([\d.]+) s after the last good round: rank (\d+): rank (\d+) sent nothing "
                         r"for ([\d.]+) s in round (\d+)", errors[0])
            assert m, errors[0]
            elapsed, me, dead, silent, rnd = float(m[1]), int(m[2]), int(m[3]), float(m[4]), int(m[5])
            also = re.search(r"also silent as long: ranks? ([\d, ]+)\)", errors[0])
            also = {int(v) for v in also[1].split(", ")} if also else set()
            # A survivor that finished the round rank 2 died in (rank 2's part for it had arrived)
            # meets, in the next, both rank 2 and the other survivor, gone after its own error: as
            # silent each, named together.
            if rnd == done + 1 and KILLED in also:
                dead = KILLED
            if (me, dead, silent) != (w.rank, KILLED, PEER_TIMEOUT):
                pytest.fail(f"rank {w.rank} blames the wrong rank: {errors[0]}\n(rank {KILLED} killed in round "
                            f"{done})\n" + "\n----\n".join(x.out for x in workers))
            assert "peer dead or unreachable" in errors[0], errors[0]
            # it failed in the round rank 2 died in (or the one after), and no sooner than peer_timeout
            assert done - 1 <= rnd <= done + 1 and rnd == w.rounds(), (done, out[-3000:])
            assert PEER_TIMEOUT <= elapsed <= PEER_TIMEOUT + EXIT_MARGIN, errors[0]
            assert waited <= PEER_TIMEOUT + EXIT_MARGIN, waited
            print(f"{kind}: rank {w.rank} exited {waited:.2f} s after the kill ({rnd} rounds): {errors[0]}")

        # the survivors closed their data planes; the killed rank's attachment (a BPF link), socket
        # and UMEM went with its process
        assert not Path(f"/proc/{victim.p.pid}").exists()
        for r in range(WORLD):
            assert host.attached_program("eth0", tb.ns(r)) is None, r
        if af_xdp:
            assert prog_gone(prog_id), f"program {prog_id} still in the kernel after its process was killed"
        assert [xdp_sockets(ns) for ns in spaces] == [0] * WORLD
        r = dblp("status")
        assert r.returncode == 0, r.stderr
        assert not [row for row in map(str.split, r.stdout.splitlines()) if row and row[0] in spaces], r.stdout

        r = dblp("unload", "--all")
        assert r.returncode == 0, r.stderr
        assert not any(ns in r.stdout for ns in spaces), r.stdout
        for ns in spaces:
            assert host.attached_program("eth0", ns) is None, ns
            assert not any(link["xdp_prog_id"] for link in net.links(ns)), ns
            assert not host.pin_dir("eth0", ns).exists(), ns
        assert not [e for e in host.loaded() if e["netns"] in spaces]
        assert pins() <= pins_before, sorted(map(str, pins() - pins_before))
        assert [xdp_sockets(ns) for ns in spaces] == [0] * WORLD

        r = dblp("testbed", "down", "--name", name)
        assert r.returncode == 0, r.stderr
        left_ns = [ns for ns in [tb.switch_ns, *spaces] if net.netns_exists(ns)]
        assert left_ns == [], left_ns
        assert not [n for n in net.netns_list() if n.startswith(name + "-")]
        assert not (core.STATE_DIR / f"{name}.json").exists()
    finally:
        for w in workers:
            w.kill()
        tb.down()
