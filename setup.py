"""Build hooks: ship the BPF sources inside the package; compile the per-packet C loops.

The programs live at the top of the repository (``bpf/``), where C tools and
readers expect them.  At build time this copies ``bpf/*.bpf.c`` and
``bpf/*.h`` into the built package as ``pydblp/bpf_src/``, where
:mod:`pydblp.bpf` looks first.

``pydblp/csrc/*.c`` are compiled as optional extensions: plain shared
libraries that :mod:`pydblp.native` loads with ctypes (no module init, never
imported).  Where no compiler exists the install goes on without them and
pydblp runs its pure-Python paths (or builds them at first use once a
compiler is there).  Each is built with ``DBLP_SOURCE_ID``, the hash of its
source, so a copy built from an older source is told apart.  Everything else
is in pyproject.toml.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithBPF(build_py):
    """build_py that also copies the BPF sources into ``pydblp/bpf_src``."""

    def run(self):
        super().run()
        sources = sorted([*ROOT.glob("bpf/*.bpf.c"), *ROOT.glob("bpf/*.h")])
        if not sources:
            raise FileNotFoundError(f"no BPF sources under {ROOT / 'bpf'} (is MANIFEST.in in the sdist?)")
        dest = Path(self.build_lib) / "pydblp" / "bpf_src"
        self.mkpath(str(dest))
        for src in sources:
            self.copy_file(str(src), str(dest / src.name))


def native(name: str) -> Extension:
    """``pydblp/csrc/<name>.c`` as the optional library ``pydblp/_<name>.<abi>.so``."""
    src = f"pydblp/csrc/{name}.c"
    ident = hashlib.sha256((ROOT / src).read_bytes()  # as pydblp.native.source_id
                           + (ROOT / "pydblp/csrc/wire.h").read_bytes()).hexdigest()[:16]
    return Extension(f"pydblp._{name}", [src], define_macros=[("DBLP_SOURCE_ID", f'"{ident}"')],
                     extra_compile_args=["-O2", "-Wno-psabi"], optional=True)


setup(cmdclass={"build_py": BuildPyWithBPF},
      ext_modules=[native("mac"), native("udp"), native("matcher"), native("xsk")])
