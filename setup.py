"""Build hook: ship the BPF sources inside the package.

The programs live at the top of the repository (``bpf/``), where C tools and
readers expect them.  At build time this copies ``bpf/*.bpf.c`` and
``bpf/*.h`` into the built package as ``pydblp/bpf_src/``, where
:mod:`pydblp.bpf` looks first; everything else is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
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


setup(cmdclass={"build_py": BuildPyWithBPF})
