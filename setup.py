"""Build hooks: ship the BPF sources inside the package; compile the per-packet C loops.

The programs live at the top of the repository (``bpf/``), where C tools and
readers expect them.  At build time this copies ``bpf/*.bpf.c`` and
``bpf/*.h`` into the built package as ``pydblp/bpf_src/``, where
:mod:`pydblp.bpf` looks first.

``pydblp/csrc/*.c`` are compiled as optional extensions: plain shared
libraries that :mod:`pydblp.native` loads with ctypes (no module init, never
imported).  Where no compiler exists the install goes on without them and
pydblp runs its pure-Python paths (or builds them at first use once a
compiler is there).  Each is built with ``DBLP_SOURCE_ID``, its
``pydblp.native.source_id`` (native.py read on its own, without importing the
package), so a copy built from an older source is told apart.  Everything else
is in pyproject.toml.
"""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _native_module():
    """pydblp/native.py alone (standard library only), without importing the package."""
    spec = importlib.util.spec_from_file_location("_pydblp_native", ROOT / "pydblp" / "native.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


NATIVE = _native_module()


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
    return Extension(f"pydblp._{name}", [f"pydblp/csrc/{name}.c"],
                     define_macros=[("DBLP_SOURCE_ID", f'"{NATIVE.source_id(name)}"')],
                     extra_compile_args=["-O2", "-Wno-psabi"], optional=True)


setup(cmdclass={"build_py": BuildPyWithBPF},
      ext_modules=[native("mac"), native("udp"), native("matcher"), native("xsk")])
