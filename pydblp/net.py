"""Network namespaces, links and XDP attachments, through pyroute2 netlink.

The control layer below :mod:`pydblp.bpf` and :mod:`pydblp.testbed`.  Every
function takes an optional ``netns`` name; ``None`` is the caller's netns.
Interface names are resolved inside that namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import fcntl
import ipaddress
import os
import socket
import struct

from pyroute2 import IPRoute
from pyroute2 import netns as _netns

from pydblp import bpf
from pydblp._libc import libc

NETNS_RUN_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000

# linux/if_link.h XDP_FLAGS_*
XDP_FLAGS_UPDATE_IF_NOEXIST = 1 << 0
XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2


class Mode(str, enum.Enum):
    """XDP attach mode, as xdp-loader spells it."""

    NATIVE = "native"
    SKB = "skb"

    @property
    def flags(self) -> int:
        return XDP_FLAGS_DRV_MODE if self is Mode.NATIVE else XDP_FLAGS_SKB_MODE


class NetError(RuntimeError):
    """A netlink or namespace operation failed; the message says what to do.  ``errno``: the
    kernel's, where one is known (an XDP attach), else None."""

    errno: int | None = None



@contextlib.contextmanager
def in_netns(name: str | None):
    """Run the body with this thread inside netns ``name`` (no-op for None).

    Sockets created in the body (AF_XDP, UDP) belong to that namespace for
    their whole life.  The thread's original netns is restored on exit.
    """
    if name is None:
        yield
        return
    path = os.path.join(NETNS_RUN_DIR, name)
    try:
        target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NetError(f"network namespace {name!r} does not exist (see `ip netns list`)") from None
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise NetError(f"setns({name}): {os.strerror(e)} (needs root)")
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:  # pragma: no cover
                raise NetError("cannot return to the original network namespace")
    finally:
        os.close(target)
        os.close(own)


def ipr(netns: str | None = None) -> IPRoute:
    """An IPRoute socket in ``netns`` (close it, or use it as a context manager).

    The socket is created in this thread after setns(2), not through
    pyroute2's ``netns=`` (which forks a helper per socket: slow, unsafe in
    a threaded process, and seen to hang under load).
    """
    with in_netns(netns):
        return IPRoute()


def netns_exists(name: str) -> bool:
    return os.path.exists(os.path.join(NETNS_RUN_DIR, name))


def netns_list() -> list[str]:
    return sorted(_netns.listnetns())


def current_netns() -> str | None:
    """The name of the named network namespace (``/run/netns``) this thread is in; None in the
    root namespace, or in one that has no name."""
    try:
        here = os.stat("/proc/thread-self/ns/net")
        for name in netns_list():
            st = os.stat(os.path.join(NETNS_RUN_DIR, name))
            if (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino):
                return name
    except OSError:
        pass
    return None


def netns_add(name: str) -> None:
    if netns_exists(name):
        raise NetError(f"network namespace {name!r} already exists")
    _netns.create(name)


def netns_del(name: str) -> None:
    """Remove a namespace; its links (and their XDP programs) go with it."""
    if netns_exists(name):
        _netns.remove(name)


def ifindex(ifname: str, netns: str | None = None) -> int:
    with ipr(netns) as ip:
        idx = ip.link_lookup(ifname=ifname)
    if not idx:
        where = f" in netns {netns}" if netns else ""
        raise NetError(f"no interface {ifname!r}{where} (see `ip link`)")
    return idx[0]


def xdp_query(ifname: str, netns: str | None = None) -> dict | None:
    """``{'mode': 'native'|'skb', 'prog_id': int}`` for the attached program, or None."""
    with ipr(netns) as ip:
        link = ip.get_links(ifindex(ifname, netns))[0]
    xdp = link.get_attr("IFLA_XDP")
    if not xdp:
        return None
    attrs = dict(xdp["attrs"])
    attached = attrs.get("IFLA_XDP_ATTACHED")
    if not attached:
        return None
    mode = {"xdp": Mode.NATIVE, "xdpgeneric": Mode.SKB, "drv": Mode.NATIVE, "skb": Mode.SKB}.get(attached, attached)
    return {"mode": mode, "prog_id": attrs.get("IFLA_XDP_PROG_ID")}


def _xdp(fd: int, flags: int) -> dict:
    # The nested form: pyroute2's xdp_fd= shortcut silently drops xdp_flags,
    # which attaches in the kernel's default mode and detaches only that mode.
    return {"xdp": {"attrs": [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", flags)]}}


def xdp_attach(ifname: str, prog_fd: int, mode: Mode = Mode.NATIVE, netns: str | None = None,
               replace: bool = True) -> None:
    """Attach ``prog_fd`` to ``ifname`` in ``mode``; with ``replace=False`` refuse to replace."""
    flags = Mode(mode).flags | (0 if replace else XDP_FLAGS_UPDATE_IF_NOEXIST)
    with ipr(netns) as ip:
        try:
            ip.link("set", index=ifindex(ifname, netns), **_xdp(prog_fd, flags))
        except Exception as e:  # pyroute2 NetlinkError carries errno in .code
            raise _attach_error(ifname, mode, getattr(e, "code", None), e) from e


def _attach_error(ifname: str, mode: Mode, code: int | None, e: Exception) -> NetError:
    """What an XDP attach that failed with errno ``code`` says: the cause and the fix."""
    hint = {errno.EBUSY: "a program is already attached (in this or another mode); unload it first",
            errno.EEXIST: "a program is already attached",
            errno.EOPNOTSUPP: "the driver lacks native XDP; try --mode skb",
            errno.EINVAL: "the program was rejected for this device (MTU too large for native XDP?)",
            }.get(code, str(e))
    err = NetError(f"cannot attach XDP to {ifname} ({Mode(mode).value}): {hint}")
    err.errno = code
    return err


def xdp_link(ifname: str, prog_fd: int, mode: Mode = Mode.NATIVE, netns: str | None = None) -> int | None:
    """Attach ``prog_fd`` to ``ifname`` in ``mode`` through a BPF link: its fd, which owns the
    attachment (closing it, or the process's exit, detaches it), or None where the kernel has no
    XDP links (before 5.9: attach with :func:`xdp_attach`).  Refuses to replace any program."""
    index = ifindex(ifname, netns)
    try:
        with in_netns(netns):  # (the link resolves the ifindex in the caller's namespace)
            return bpf.link_create_xdp(prog_fd, index, Mode(mode).flags)
    except bpf.BPFError as e:
        if e.errno == errno.EINVAL and not _xdp_links():
            return None
        raise _attach_error(ifname, mode, e.errno, e) from e


def _xdp_links() -> bool:
    """Whether this kernel has XDP links (5.9+)."""
    import platform
    import re

    m = re.match(r"(\d+)\.(\d+)", platform.release())
    return bool(m) and (int(m[1]), int(m[2])) >= (5, 9)


def xdp_detach(ifname: str, mode: Mode | None = None, netns: str | None = None) -> bool:
    """Detach with the mode's own flags (a flagless detach misses skb programs).

    ``mode=None`` uses the mode found attached.  Returns False if nothing was attached.
    """
    found = xdp_query(ifname, netns)
    if found is None:
        return False
    mode = Mode(mode or found["mode"])
    with ipr(netns) as ip:
        try:
            ip.link("set", index=ifindex(ifname, netns), **_xdp(-1, mode.flags))
        except Exception as e:  # pyroute2 NetlinkError carries errno in .code
            if getattr(e, "code", None) == errno.EBUSY:  # (the kernel refuses to detach a link's program)
                raise NetError(f"the XDP program on {ifname} belongs to a running process (a BPF link): stop "
                               "that process; its program goes with it") from e
            raise NetError(f"cannot detach XDP from {ifname}: {e}") from e
    return True


def links(netns: str | None = None) -> list[dict]:
    """``[{'ifname', 'index', 'xdp'}]`` for every link in ``netns``."""
    out = []
    with ipr(netns) as ip:
        for link in ip.get_links():
            name = link.get_attr("IFLA_IFNAME")
            xdp = link.get_attr("IFLA_XDP")
            attrs = dict(xdp["attrs"]) if xdp else {}
            prog = attrs.get("IFLA_XDP_PROG_ID") if attrs.get("IFLA_XDP_ATTACHED") else None
            out.append({"ifname": name, "index": link["index"], "xdp_prog_id": prog,
                        "xdp_attached": attrs.get("IFLA_XDP_ATTACHED")})
    return out


SIOCETHTOOL = 0x8946
ETHTOOL_GGRO, ETHTOOL_SGRO, ETHTOOL_STXCSUM = 0x2B, 0x2C, 0x17


def ethtool_value(ifname: str, cmd: int, value: int | None = None, netns: str | None = None) -> int:
    """An ethtool_value command (``ETHTOOL_G*`` reads, ``ETHTOOL_S*`` with ``value`` writes); returns the value.

    Raises OSError from the ioctl (ENODEV: no such interface; EOPNOTSUPP: the driver lacks it).
    """
    val = ctypes.create_string_buffer(struct.pack("=II", cmd, value or 0), 8)
    ifr = struct.pack("16sP", ifname.encode(), ctypes.addressof(val))
    with in_netns(netns), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifr)
    return struct.unpack("=II", val.raw)[1]


def iface_addr(ifname: str, netns: str | None = None) -> str:
    """The first IPv4 address of ``ifname``; NetError when it has none."""
    with ipr(netns) as ip:
        for a in ip.get_addr(index=ifindex(ifname, netns)):
            addr = a.get_attr("IFA_ADDRESS")
            if addr and ipaddress.ip_address(addr).version == 4:
                return addr
    raise NetError(f"{ifname} has no IPv4 address; pass addr=")


def iface_mac(ifname: str, netns: str | None = None) -> str:
    """The MAC address of ``ifname``, as ``aa:bb:cc:dd:ee:ff``."""
    with ipr(netns) as ip:
        return ip.get_links(ifindex(ifname, netns))[0].get_attr("IFLA_ADDRESS")


def iface_mtu(ifname: str, netns: str | None = None) -> int:
    """The MTU of ``ifname``."""
    with ipr(netns) as ip:
        return int(ip.get_links(ifindex(ifname, netns))[0].get_attr("IFLA_MTU"))
