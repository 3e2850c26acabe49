"""BPF control layer: compile with bcc, maps and pins through the bpf syscall.

Compiling costs seconds, so each program is compiled once per
:class:`Program` and its maps are shared by every use of that object.  Map
access (:class:`Map`) needs only a file descriptor or a pinned path, so
commands that inspect a loaded program (``dblp stats``) never compile.
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
import shutil
import struct
import threading
from pathlib import Path

from pydblp._libc import libc


def _bpf_dir() -> Path:
    """Where the BPF sources are: ``$DBLP_BPF_DIR``, else the installed package's copy
    (``pydblp/bpf_src``, put there by the build: setup.py), else the checkout's ``bpf/``."""
    if os.environ.get("DBLP_BPF_DIR"):
        return Path(os.environ["DBLP_BPF_DIR"])
    here = Path(__file__).resolve().parent
    packaged = here / "bpf_src"
    return packaged if (packaged / "dblp.h").exists() else here.parent / "bpf"


BPF_DIR = _bpf_dir()
BPFFS = Path("/sys/fs/bpf")
PIN_ROOT = BPFFS / "dblp"

# linux/bpf.h commands and map types used here
BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_DELETE_ELEM = 3
BPF_MAP_GET_NEXT_KEY = 4
BPF_PROG_LOAD = 5
BPF_OBJ_PIN = 6
BPF_OBJ_GET = 7
BPF_PROG_TEST_RUN = 10
BPF_PROG_GET_FD_BY_ID = 13
BPF_MAP_GET_FD_BY_ID = 14
BPF_LINK_CREATE = 28
BPF_XDP = 37  # enum bpf_attach_type: a link's XDP attachment
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_TYPE_XDP = 6
BPF_F_XDP_HAS_FRAGS = 1 << 5  # the program handles multi-buffer frames (5.18+)
BPF_XDP_DEVMAP = 33  # enum bpf_attach_type: a devmap entry's egress program
PERCPU_TYPES = {5, 6, 10}  # PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH
_NR_BPF = 321  # x86_64

libc.syscall.restype = ct.c_long


class BPFError(OSError):
    """A bpf(2) call failed."""


def _sys_bpf(cmd: int, attr: bytes | ct.Array) -> int:
    buf = attr if isinstance(attr, ct.Array) else ct.create_string_buffer(attr, 128)
    r = libc.syscall(_NR_BPF, cmd, buf, ct.sizeof(buf))
    if r < 0:
        e = ct.get_errno()
        raise BPFError(e, f"bpf(cmd={cmd}): {os.strerror(e)}")
    return r


def _addr(b) -> int:
    return ct.addressof(b)


def possible_cpus() -> int:
    """Number of possible CPUs: the per-CPU value stride of per-CPU maps."""
    text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


class Map:
    """A BPF map by file descriptor; keys and values are bytes.

    Per-CPU maps return one value per possible CPU (a list of bytes).
    The object owns ``fd`` and closes it on :meth:`close`.
    """

    def __init__(self, fd: int, owned: bool = True):
        self.fd = fd
        self._owned = owned
        info = ct.create_string_buffer(80)
        attr = struct.pack("=IIQ", fd, 80, _addr(info))
        _sys_bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
        self.type, self.id, self.key_size, self.value_size, self.max_entries, _ = struct.unpack_from("=6I", info)
        self.name = info.raw[24:40].split(b"\0")[0].decode()
        self.percpu = self.type in PERCPU_TYPES
        self._ncpu = possible_cpus() if self.percpu else 1
        self._stride = (self.value_size + 7) & ~7 if self.percpu else self.value_size

    @classmethod
    def pinned(cls, path: str | os.PathLike) -> "Map":
        return cls(obj_get(path))

    def _kv(self, key: bytes):
        if len(key) != self.key_size:
            raise ValueError(f"map {self.name}: key is {len(key)} bytes, want {self.key_size}")
        return ct.create_string_buffer(key, self.key_size)

    def lookup(self, key: bytes) -> bytes | list[bytes] | None:
        k = self._kv(key)
        v = ct.create_string_buffer(self._stride * self._ncpu)
        try:
            _sys_bpf(BPF_MAP_LOOKUP_ELEM, struct.pack("=IIQQQ", self.fd, 0, _addr(k), _addr(v), 0))
        except BPFError as e:
            if e.errno == errno.ENOENT:
                return None
            raise
        if self.percpu:
            return [v.raw[i * self._stride: i * self._stride + self.value_size] for i in range(self._ncpu)]
        return v.raw

    def update(self, key: bytes, value: bytes, flags: int = 0) -> None:
        if self.percpu:
            value = b"".join(value[:self.value_size].ljust(self._stride, b"\0") for _ in range(self._ncpu))
        elif len(value) != self.value_size:
            raise ValueError(f"map {self.name}: value is {len(value)} bytes, want {self.value_size}")
        k = self._kv(key)
        v = ct.create_string_buffer(value, len(value))
        _sys_bpf(BPF_MAP_UPDATE_ELEM, struct.pack("=IIQQQ", self.fd, 0, _addr(k), _addr(v), flags))

    def delete(self, key: bytes) -> bool:
        k = self._kv(key)
        try:
            _sys_bpf(BPF_MAP_DELETE_ELEM, struct.pack("=IIQQQ", self.fd, 0, _addr(k), 0, 0))
        except BPFError as e:
            if e.errno == errno.ENOENT:
                return False
            raise
        return True

    def keys(self) -> list[bytes]:
        out = []
        cur = None
        nxt = ct.create_string_buffer(self.key_size)
        while True:
            kaddr = 0 if cur is None else _addr(cur)
            try:
                _sys_bpf(BPF_MAP_GET_NEXT_KEY, struct.pack("=IIQQ", self.fd, 0, kaddr, _addr(nxt)))
            except BPFError as e:
                if e.errno == errno.ENOENT:
                    return out
                raise
            out.append(nxt.raw)
            cur = ct.create_string_buffer(nxt.raw, self.key_size)

    def items(self):
        for k in self.keys():
            v = self.lookup(k)
            if v is not None:
                yield k, v

    def clear(self) -> None:
        for k in self.keys():
            self.delete(k)

    def close(self) -> None:
        if self._owned and self.fd >= 0:
            os.close(self.fd)
        self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def obj_pin(fd: int, path: str | os.PathLike) -> None:
    p = ct.create_string_buffer(os.fsencode(str(path)))
    _sys_bpf(BPF_OBJ_PIN, struct.pack("=QII", _addr(p), fd, 0))


def obj_get(path: str | os.PathLike) -> int:
    p = ct.create_string_buffer(os.fsencode(str(path)))
    try:
        return _sys_bpf(BPF_OBJ_GET, struct.pack("=QII", _addr(p), 0, 0))
    except BPFError as e:
        if e.errno == errno.ENOENT:
            raise FileNotFoundError(f"no pinned BPF object at {path}") from None
        raise


def prog_info(fd: int) -> dict:
    """``{'id', 'type', 'name'}`` of a loaded program."""
    info = ct.create_string_buffer(256)
    _sys_bpf(BPF_OBJ_GET_INFO_BY_FD, struct.pack("=IIQ", fd, 256, _addr(info)))
    ptype, pid = struct.unpack_from("=II", info)
    return {"id": pid, "type": ptype, "name": info.raw[64:80].split(b"\0")[0].decode()}


def prog_info_by_id(prog_id: int) -> dict | None:
    """Like :func:`prog_info` for a program id; None if it no longer exists."""
    try:
        fd = _sys_bpf(BPF_PROG_GET_FD_BY_ID, struct.pack("=III", prog_id, 0, 0))
    except BPFError as e:
        if e.errno == errno.ENOENT:
            return None
        raise
    try:
        return prog_info(fd)
    finally:
        os.close(fd)


def link_create_xdp(prog_fd: int, ifindex: int, flags: int) -> int:
    """Attach XDP program ``prog_fd`` to ``ifindex`` (in the calling thread's network namespace)
    through a BPF link (Linux 5.9+): the attachment lasts while the returned fd is open, so the
    kernel detaches it when the process dies, however it dies.  ``flags``: the XDP mode's."""
    return _sys_bpf(BPF_LINK_CREATE, struct.pack("=IIII", prog_fd, ifindex, BPF_XDP, flags))


def prog_maps(prog_id: int) -> dict[str, "Map"]:
    """The maps a loaded program uses, by name (the kernel keeps 15 characters of it): what the
    CLI reads of a program nobody pinned.  Empty if the program no longer exists.  The caller
    closes them."""
    try:
        fd = _sys_bpf(BPF_PROG_GET_FD_BY_ID, struct.pack("=III", prog_id, 0, 0))
    except BPFError as e:
        if e.errno == errno.ENOENT:
            return {}
        raise
    try:
        ids = (ct.c_uint32 * 64)()
        info = ct.create_string_buffer(256)  # struct bpf_prog_info: nr_map_ids at 52, map_ids at 56
        struct.pack_into("=IQ", info, 52, len(ids), ct.addressof(ids))
        _sys_bpf(BPF_OBJ_GET_INFO_BY_FD, struct.pack("=IIQ", fd, 256, _addr(info)))
        count = min(struct.unpack_from("=I", info, 52)[0], len(ids))
    finally:
        os.close(fd)
    out = {}
    try:
        for map_id in ids[:count]:
            try:
                fd = _sys_bpf(BPF_MAP_GET_FD_BY_ID, struct.pack("=III", map_id, 0, 0))
            except BPFError as e:
                if e.errno == errno.ENOENT:  # (gone since)
                    continue
                raise
            try:
                m = Map(fd)
            except BaseException:
                os.close(fd)
                raise
            out[m.name] = m
    except BaseException:
        for m in out.values():
            m.close()
        raise
    return out


def test_run(prog_fd: int, data: bytes, repeat: int = 1) -> tuple[int, bytes]:
    """BPF_PROG_TEST_RUN: run an XDP program on one frame; return (verdict, frame out)."""
    din = ct.create_string_buffer(bytes(data), len(data))
    dout = ct.create_string_buffer(len(data) + 512)
    attr = ct.create_string_buffer(struct.pack("=IIIIQQII", prog_fd, 0, len(data), len(dout),
                                               _addr(din), _addr(dout), repeat, 0), 128)
    _sys_bpf(BPF_PROG_TEST_RUN, attr)
    retval, size_out = struct.unpack_from("=II", attr, 4)[0], struct.unpack_from("=I", attr, 12)[0]
    return retval, dout.raw[:size_out]


# bcc's clang/LLVM aborts the process when two threads compile at once (two data planes
# opened at once in one process): one compile at a time
_compiling = threading.Lock()


def compile(name: str, cflags: list[str] | tuple[str, ...] = ()):
    """Compile ``bpf/<name>`` with bcc (a few seconds); returns the ``bcc.BPF`` object."""
    try:
        from bcc import BPF
    except ModuleNotFoundError:
        raise BPFError("bcc does not import: install Debian's python3-bpfcc and link it "
                       "into this venv (README, 'Install')") from None

    src = BPF_DIR / name
    if not src.exists():
        raise FileNotFoundError(f"BPF source {src} not found (set DBLP_BPF_DIR?)")
    # Debian's 6.12 headers repeat __seg_gs in x86's per-CPU macros: six warnings a compile, none ours
    with _compiling:
        return BPF(src_file=str(src).encode(), cflags=[f"-I{BPF_DIR}", "-Wno-duplicate-decl-specifier", *cflags])


_frags: bool | None = None


def _prog_load(insns: int, count: int, license_addr: int, name: bytes, flags: int, log=None,
               attach_type: int = 0) -> int:
    attr = ct.create_string_buffer(128)
    struct.pack_into("=IIQQIIQII16sII", attr, 0, BPF_PROG_TYPE_XDP, count, insns, license_addr,
                     1 if log is not None else 0, len(log) if log is not None else 0,
                     _addr(log) if log is not None else 0, 0, flags, name[:15], 0, attach_type)
    return _sys_bpf(BPF_PROG_LOAD, attr)


def xdp_frags_supported() -> bool:
    """Whether the kernel loads multi-buffer XDP programs (``BPF_F_XDP_HAS_FRAGS``, 5.18+); cached."""
    global _frags
    if _frags is None:
        prog = ct.create_string_buffer(struct.pack("=BBhiBBhi", 0xB7, 0, 0, 2, 0x95, 0, 0, 0))  # r0 = XDP_PASS; exit
        lic = ct.create_string_buffer(b"GPL")
        try:
            os.close(_prog_load(_addr(prog), 2, _addr(lic), b"dblp_probe", BPF_F_XDP_HAS_FRAGS))
            _frags = True
        except BPFError as e:
            if e.errno == errno.EPERM:
                return False  # not root: nothing can be loaded anyway (not cached)
            if e.errno != errno.EINVAL:
                raise
            _frags = False
    return _frags


def compile_xdp(name: str, func: str, cflags: list[str] | tuple[str, ...] = ()):
    """Compile ``bpf/<name>`` and load its XDP function ``func``; returns ``(bcc object, fn)``.

    Where the kernel has multi-buffer XDP (5.18+), the program is loaded with
    ``BPF_F_XDP_HAS_FRAGS``: only such a program attaches natively to a veth
    whose MTU exceeds one page (about 3500 bytes) and sees jumbo frames
    whole.  bcc's ``load_func`` has no flag for it, so bcc compiles (with
    ``-DDBLP_FRAGS=1``: ``dblp_frame_len`` then counts the fragments) and
    its instructions, map references already resolved to the object's map
    fds, go to BPF_PROG_LOAD here.  Elsewhere bcc loads it plainly and MTUs
    stay within a page.  ``fn.fd`` is the program, ``fn.frags`` which load
    it got; ``b.cleanup()`` closes both.
    """
    frags = xdp_frags_supported()
    b = compile(name, [*cflags, f"-DDBLP_FRAGS={int(frags)}"])
    try:
        return b, load_xdp(b, func, frags)
    except BaseException:
        b.cleanup()
        raise


def load_xdp(b, func: str, frags: bool, attach_type: int = 0):
    """Load XDP function ``func`` of compiled bcc object ``b`` (see :func:`compile_xdp`), multi-buffer
    if ``frags``; ``attach_type`` ``BPF_XDP_DEVMAP`` for a devmap entry's egress program.  Returns
    bcc's Function (``fn.fd``, ``fn.frags``); ``b.cleanup()`` closes it."""
    from bcc import BPF, libbcc

    key = func.encode()
    if not frags:
        fn = b.load_func(key, BPF.XDP, attach_type=attach_type or -1)
        fn.frags = False
        return fn
    lib = libbcc.lib
    start = lib.bpf_function_start(b.module, key)
    if not start:
        raise BPFError(errno.ENOENT, f"no function {func!r} in the compiled object")
    lic_buf = ct.create_string_buffer(lib.bpf_module_license(b.module))
    lic = _addr(lic_buf)
    count = lib.bpf_function_size(b.module, key) // 8
    try:
        fd = _prog_load(start, count, lic, key, BPF_F_XDP_HAS_FRAGS, attach_type=attach_type)
    except BPFError as e:
        log = ct.create_string_buffer(1 << 20)  # again with the verifier's log, for the message
        try:
            os.close(_prog_load(start, count, lic, key, BPF_F_XDP_HAS_FRAGS, log, attach_type))
        except BPFError:
            pass
        raise BPFError(e.errno, f"loading {func}: {e.strerror}\n"
                       + log.value.decode(errors="replace")[-2000:]) from None
    fn = b.funcs[key] = BPF.Function(b, key, fd)
    fn.frags = True
    return fn


def unpin(path: Path) -> None:
    """Remove a pin directory and prune empty parents up to PIN_ROOT."""
    if path.exists():
        shutil.rmtree(path)
    for parent in path.parents:
        if parent == PIN_ROOT.parent or not parent.exists():
            break
        try:
            parent.rmdir()
        except OSError:
            break


def require_bpffs() -> None:
    if not os.path.ismount(BPFFS):
        raise BPFError(f"bpffs is not mounted at {BPFFS}: mount -t bpf bpf {BPFFS} (tools/setup does)")
