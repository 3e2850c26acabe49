"""The compiled per-packet loops: ``pydblp/csrc/*.c``, loaded with ctypes.

Python decides (the protocol, its timers and estimators); C only runs loops over
packets that Python would otherwise run in numpy calls per batch.  Each library
has a pure-Python twin that stays the reference: the suite runs both on the same
seeded inputs and requires identical results (docs/architecture.md, "Native
code").  Libraries reach a process one of three ways, tried in order:

installed   ``pip install .`` compiles each source as an optional extension
            (setup.py; ``-O2``, no CPU-specific flags) next to this module as
            ``_<name>.<abi>.so``.  Python never imports it: it has no module
            init, ctypes loads it.  A copy built from another version of the
            source (an editable install whose C changed since) is passed over.
first use   otherwise (first, for a library loaded ``tuned``: ``mac``, whose
            lanes are SIMD vectors) compiled with the system C compiler (``$CC``, else
            ``cc``; ``-O2 -march=native``, without ``-march=native`` if the
            compiler refuses it) into ``$XDG_CACHE_HOME/pydblp``
            (``~/.cache/pydblp``), named by a hash of the source, compiler and
            CPU, so a later process loads it without compiling.
none        no compiler, a failed build, an unwritable cache, a failed self
            test, or ``DBLP_NATIVE=0``: the pure-Python path, with one logged
            line per library and process saying why.

``DBLP_NATIVE=0`` forces the pure-Python paths (to compare, or to rule the C
out); ``DBLP_NATIVE=1`` makes a missing library an error instead of a note.
Every library exports ``dblp_source_id()``, the first 16 hex digits of the
SHA-256 of the source it was built from: that is how a stale copy is told.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = (["-O2", "-march=native"], ["-O2"])  # tried in turn
COMMON = ["-shared", "-fPIC", "-Wno-psabi"]
ENV = "DBLP_NATIVE"

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}
_why: dict[str, str] = {}


class NativeUnavailable(RuntimeError):
    """A compiled library was required (``native=True`` or ``DBLP_NATIVE=1``) and is unavailable."""


def _source(name: str) -> bytes:
    """What a build of ``csrc/<name>.c`` is made of: the source and the header the sources
    include (``csrc/wire.h``)."""
    return (CSRC / f"{name}.c").read_bytes() + (CSRC / "wire.h").read_bytes()


def source_id(name: str) -> str:
    """The id a build of ``csrc/<name>.c`` carries: the SHA-256 of :func:`_source`, first 16 hex
    digits."""
    return hashlib.sha256(_source(name)).hexdigest()[:16]


def mode() -> bool | None:
    """``DBLP_NATIVE``: False (``0``: never), True (``1``: required) or None (unset: where available).

    Raises:
        ValueError: any other value.
    """
    v = os.environ.get(ENV, "").strip().lower()
    if v in ("", "auto"):
        return None
    if v in ("0", "off", "no", "false"):
        return False
    if v in ("1", "on", "yes", "true"):
        return True
    raise ValueError(f"{ENV}={v!r}: use 0 (pure Python), 1 (compiled, required) or leave it unset")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pydblp"


def _cpu() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def build(name: str) -> Path:
    """The path of ``csrc/<name>.c`` compiled into the cache, compiling it first unless it is there.

    Raises:
        OSError: no compiler, an unwritable cache, an unsafe cached file, or the compiler failed
            with every set of flags.
    """
    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        raise OSError(f"no C compiler ({os.environ.get('CC') or 'cc'}) on PATH")
    source = CSRC / f"{name}.c"
    src = _source(name)
    version = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    ident = hashlib.sha256(b"\0".join([src, cc.encode(), version, platform.machine().encode(),
                                       _cpu().encode(), repr(FLAGS).encode()])).hexdigest()[:20]
    d = _cache_dir()
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    so = d / f"{name}-{ident}.so"
    if so.exists():
        st = so.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise OSError(f"{so} is not this user's alone: delete it")
        return so
    define = f'-DDBLP_SOURCE_ID="{source_id(name)}"'
    err = None
    for flags in FLAGS:
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{name}-", suffix=".so")
        os.close(fd)
        try:
            subprocess.run([cc, *flags, *COMMON, define, "-o", tmp, str(source)], check=True,
                           capture_output=True, timeout=120)
            os.replace(tmp, so)  # atomic: ranks building at once each load a whole file
            return so
        except subprocess.CalledProcessError as e:
            err = e
            log.debug("cc %s failed: %s", " ".join(flags), e.stderr.decode(errors="replace")[-500:])
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise OSError(f"{cc} failed on {source.name} (exit status {err.returncode}; DEBUG logging shows its "
                  "output)") from err


def _installed(name: str) -> ctypes.CDLL | None:
    """The copy ``pip install`` built next to this module, if there is one built from this source."""
    want = source_id(name)
    for so in sorted(Path(__file__).resolve().parent.glob(f"_{name}.*so")):
        try:
            lib = ctypes.CDLL(str(so))
            lib.dblp_source_id.restype = ctypes.c_char_p
            got = lib.dblp_source_id().decode()
        except (OSError, AttributeError) as e:
            log.debug("%s: not loadable (%s)", so, e)
            continue
        if got == want:
            return lib
        log.debug("%s: built from source %s, this is %s: compiling this one", so, got, want)
    return None


def load(name: str, declare: Callable[[ctypes.CDLL], None],
         selftest: Callable[[ctypes.CDLL], bool] | None = None, what: str = "",
         tuned: bool = False) -> ctypes.CDLL | None:
    """``csrc/<name>.c`` as a ctypes library, found or built once per process; None where unavailable.

    Args:
        name: the source's name without ``.c``.
        declare: sets the functions' argtypes and restype.
        selftest: checks the library against the pure-Python path; False: unusable.
        what: what the pure-Python fallback costs, for the one line logged when it is taken.
        tuned: try the first-use build (``-march=native``) before the installed copy, which has
            no CPU-specific flags: for a library whose loops are the CPU's vectors (``mac``: its
            lanes ran about 4x slower built for the baseline CPU); the installed copy where no
            compiler is.

    Raises:
        NativeUnavailable: ``DBLP_NATIVE=1`` and the library is unavailable.
    """
    with _lock:
        if name not in _libs:
            lib = None
            if mode() is False:
                _why[name] = f"{ENV}=0"
            else:
                try:
                    if tuned:  # (this CPU's build; no compiler or a failed build: the installed copy)
                        try:
                            lib = ctypes.CDLL(str(build(name)))
                        except OSError:
                            lib = _installed(name)
                            if lib is None:
                                raise
                    else:
                        lib = _installed(name) or ctypes.CDLL(str(build(name)))
                    declare(lib)
                    if selftest is not None and not selftest(lib):
                        raise RuntimeError("its results differ from the pure-Python path's (a miscompiled build?)")
                except Exception as e:  # noqa: BLE001 - every failure means the same: the Python path
                    lib = None
                    _why[name] = f"{type(e).__name__}: {e}"
                    log.warning("pydblp: compiled %s unavailable (%s); using the pure-Python path%s "
                                "(install a C compiler: apt install gcc)", name, _why[name],
                                f", {what}" if what else "")
            _libs[name] = lib
        lib = _libs[name]
    if lib is None and mode() is True:
        raise NativeUnavailable(f"compiled {name} required ({ENV}=1) but unavailable: {_why.get(name)}")
    return lib


def why(name: str) -> str | None:
    """Why ``name`` is unavailable (None: it loaded, or was never tried)."""
    return _why.get(name)


def choose(native: bool | None, lib: ctypes.CDLL | None, name: str) -> ctypes.CDLL | None:
    """The library an object uses: ``native`` True (required), False (never) or None (``lib`` if any).

    Raises:
        NativeUnavailable: ``native=True`` and ``lib`` is None.
    """
    if native is False:
        return None
    if native and lib is None:
        raise NativeUnavailable(f"compiled {name} unavailable: {_why.get(name)}")
    return lib
