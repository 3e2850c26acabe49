"""docs/ against the code: every CLI command and option, packet kind, flag,
header field and BPF map is documented, and nothing tracked points outside
the repository."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pydblp import cli, wire

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
HEADING = re.compile(r"^(#+)\s+(.*)$")


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("dblp",)):
    """(path, parser) of every subcommand under ``parser``, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from commands(sub, (*path, name))


def options(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions if not isinstance(a, argparse._HelpAction) for s in a.option_strings]


def sections(text: str) -> dict[str, tuple[str, str]]:
    """Backticked heading text -> (the section with its subsections, its text before the first subheading)."""
    lines = text.splitlines()
    heads = [(i, len(m[1]), m[2]) for i, line in enumerate(lines) if (m := HEADING.match(line))]
    out = {}
    for k, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[k + 1:] if lv <= level), len(lines))
        first_sub = heads[k + 1][0] if k + 1 < len(heads) else len(lines)
        for name in re.findall(r"`([^`]+)`", title):
            out[name] = ("\n".join(lines[i:end]), "\n".join(lines[i:min(end, first_sub)]))
    return out


def mentions(text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def test_every_cli_command_and_option_in_cli_md():
    text = (DOCS / "cli.md").read_text()
    secs = sections(text)
    found = list(commands(cli.build_parser()))
    assert len(found) > 15  # the walk reached the nested subcommands
    missing = []
    for path, parser in found:
        name = " ".join(path)
        if name not in secs:
            missing.append(f"no heading `{name}`")
            continue
        # an option may be documented in its own section or in an ancestor's introduction
        scopes = [secs[name][0]] + [secs[" ".join(path[:k])][1] for k in range(2, len(path))
                                    if " ".join(path[:k]) in secs]
        missing += [f"{name} {opt}" for opt in options(parser)
                    if not any(mentions(s, opt) for s in scopes)]
    assert not missing, "docs/cli.md lacks: " + ", ".join(missing)


def test_every_packet_kind_flag_and_field_in_wire_md():
    text = (DOCS / "wire.md").read_text()
    names = ([f"`{k.name}`" for k in wire.Kind] + [f"`{f.name}`" for f in wire.Flag]
             + [f"`{name}`" for name, _ in wire.FIELDS] + [f"`{r.name}`" for r in wire.Reason]
             + [f"`{d.name}`" for d in wire.Dtype])
    missing = [n for n in names if n not in text]
    assert not missing, "docs/wire.md lacks: " + ", ".join(missing)


# bcc map declarations: the name is the first argument, except for BPF_TABLE-like
# macros (type, key, value, name, ...) and BPF_XDP_REDIRECT_MAP (type, value, name, ...)
MAP_DECL = re.compile(r"\b(BPF_\w+)\s*\(([^;]*?)\)\s*;", re.S)
NAME_ARG = {"BPF_TABLE": 3, "BPF_F_TABLE": 3, "BPF_TABLE_PINNED": 3, "BPF_XDP_REDIRECT_MAP": 2}


def bpf_maps() -> dict[str, list[str]]:
    out = {}
    for src in sorted((ROOT / "bpf").glob("*.bpf.c")):
        names = []
        for macro, args in MAP_DECL.findall(src.read_text()):
            if not (macro in NAME_ARG or re.fullmatch(r"BPF_(PERCPU_)?(ARRAY|HASH)|BPF_\w*MAP\w*|BPF_[A-Z_]*TABLE", macro)):
                continue
            parts = [a.strip() for a in args.split(",")]
            names.append(parts[NAME_ARG.get(macro, 0)])
        out[src.name] = names
    return out


def test_every_bpf_map_in_xdp_md():
    text = (DOCS / "xdp.md").read_text()
    maps = bpf_maps()
    assert "xsks" in maps["dblp_host.bpf.c"] and "bcast" in maps["fabric.bpf.c"]  # the parser sees them
    missing = [f"{src}: {m}" for src, names in maps.items() for m in names if f"`{m}`" not in text]
    assert not missing, "docs/xdp.md lacks: " + ", ".join(missing)


def test_no_tracked_file_points_outside_the_repository():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    # (built from pieces so this file does not match itself)
    outside = re.compile(r"\.\./" + "shared|DESIGN" + r"\.md")
    bad = []
    for name in files.decode().split("\0"):
        p = ROOT / name
        if not name or not p.is_file():
            continue
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if outside.search(line):
                bad.append(f"{name}:{n}")
    assert not bad, "references to a path outside the repository: " + ", ".join(bad)
