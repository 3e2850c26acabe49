"""Cap one process's CPU with a cgroup: a testbed rank that cannot keep up with its traffic.

:class:`CpuCap` makes a cgroup of its own, limits it to ``share`` of one
CPU (CFS bandwidth control: ``cpu.max`` on cgroup v2, ``cpu.cfs_quota_us``
on v1's ``cpu`` controller), moves the process and its threads into it, and
on :meth:`CpuCap.close` moves whatever is still alive back to the cgroup
it came from and removes its own.  A cap whose owner died without closing it
(SIGKILL) is removed by the next cap made beside it.  A capped receiver drains its AF_XDP
ring late, so the ring fills and the host program's pressure rises: the
shedding that ``dblp stats`` counts per priority.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from pydblp._libc import pid_alive

log = logging.getLogger(__name__)

CGROUP = Path("/sys/fs/cgroup")
PERIOD_US = 100_000  # the CFS period: the process runs share * 100 ms of every 100 ms
NAME_RE = re.compile(r"dblp-cap-(\d+)-(\d+)$")  # dblp-cap-<owner pid>-<capped pid>


class CpuCapError(RuntimeError):
    pass


def _v2_root() -> Path | None:
    """The cgroup v2 mount whose controllers include cpu, or None."""
    for root in (CGROUP, CGROUP / "unified"):
        ctl = root / "cgroup.controllers"
        if ctl.exists() and "cpu" in ctl.read_text().split():
            return root
    return None


def _v1_root() -> Path | None:
    for name in ("cpu", "cpu,cpuacct"):
        root = CGROUP / name
        if (root / "cpu.cfs_quota_us").exists():
            return root
    return None


def _own_cgroup(pid: int, v2: bool) -> str:
    """The process's cgroup path (relative to the hierarchy's root) for cpu."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        num, ctrls, path = line.split(":", 2)
        if (v2 and num == "0") or (not v2 and "cpu" in ctrls.split(",")):
            return path.lstrip("/")
    return ""


class CpuCap:
    """Limit process ``pid`` (all its threads) to ``share`` of one CPU until :meth:`close`.

    Args:
        pid: a live process this caller started.
        share: the CPU it may use, as a fraction of one core, in (0, 1].

    Raises:
        CpuCapError: the share is out of range, the kernel has no CPU
            bandwidth control here, or the cgroup cannot be made (one line).
    """

    def __init__(self, pid: int, share: float):
        if not 0 < share <= 1:
            raise CpuCapError(f"CPU share {share:g}: use a fraction of one core in (0, 1], e.g. 0.3")
        self.pid, self.share = pid, share
        v2 = _v2_root()
        root = v2 or _v1_root()
        if root is None:
            raise CpuCapError("no cgroup CPU controller (cgroup v2 cpu.max or v1 cpu.cfs_quota_us): "
                              "mount one, or run without --starve")
        self._v2 = v2 is not None
        self._home = root / _own_cgroup(pid, self._v2)
        if not self._home.is_dir():
            self._home = root
        try:
            self._sweep()
        except OSError as e:
            raise CpuCapError(f"cannot clear a dead owner's cap in {self._home}: {e.strerror or e}") from None
        self.path = self._home / f"dblp-cap-{os.getpid()}-{pid}"
        quota = max(1000, int(PERIOD_US * share))
        try:
            self.path.mkdir()
            if self._v2:
                (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
            self._move(self.path, self._tids())
        except OSError as e:
            self.close()
            raise CpuCapError(f"cannot cap pid {pid}'s CPU in {self.path}: {e.strerror or e}") from None

    def _sweep(self) -> None:
        """Remove the caps beside this one whose owner is gone, releasing what they still hold."""
        try:
            found = [d for d in self._home.iterdir() if NAME_RE.match(d.name)]
        except OSError:
            return
        for d in found:
            if not pid_alive(int(NAME_RE.match(d.name).group(1))):
                log.info("removing cgroup %s: its owner has ended", d)
                self._release(d)

    def _tids(self) -> list[int]:
        try:
            return [int(t) for t in os.listdir(f"/proc/{self.pid}/task")]
        except FileNotFoundError:
            return []

    def _move(self, to: Path, tids: list[int]) -> None:
        # v1 moves threads one by one through `tasks`; v2 moves a process whole
        target = to / ("cgroup.procs" if self._v2 else "tasks")
        for t in [self.pid] if self._v2 else tids:
            try:
                target.write_text(str(t))
            except ProcessLookupError:
                pass  # (gone: nothing to move)

    def throttled(self) -> int:
        """How many CFS periods the cgroup was throttled in so far (``cpu.stat`` nr_throttled)."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == "nr_throttled":
                return int(v)
        return 0

    def close(self) -> None:
        """Move what is left of the process back, then remove the cgroup (idempotent)."""
        self._release(self.path)

    def _release(self, path: Path) -> None:
        """Move every task left in cgroup ``path`` to this cap's home, then remove ``path``."""
        if not path.exists():
            return
        # (threads started after the move joined the cgroup too; v2 moves processes whole)
        try:
            left = [int(t) for t in (path / ("cgroup.procs" if self._v2 else "tasks")).read_text().split()]
        except OSError:
            left = []
        target = self._home / ("cgroup.procs" if self._v2 else "tasks")
        for t in left:
            try:
                target.write_text(str(t))
            except ProcessLookupError:
                pass  # (gone: nothing to move)
        try:
            path.rmdir()
        except OSError as e:
            log.warning("cgroup %s not removed: %s", path, e)

    def __enter__(self) -> "CpuCap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
