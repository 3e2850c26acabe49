"""bpf/dblp.h and pydblp/wire.py define the same header and constants.

Nothing here restates a number: a C program is generated from the Python
definitions and compiled against dblp.h, and dblp.h is parsed so that a
constant or member added to C alone is caught too.  The mutation tests at
the bottom prove the check fails when either side changes alone.
"""

from __future__ import annotations

import enum
import importlib
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from pydblp import wire

HEADER = Path(__file__).resolve().parents[2] / "bpf" / "dblp.h"
GCC = shutil.which("gcc")
pytestmark = pytest.mark.skipif(GCC is None, reason="gcc not installed: cannot compile bpf/dblp.h")

# C macro prefix -> the Python enum whose members it mirrors
ENUMS = {"KIND_": wire.Kind, "DTYPE_": wire.Dtype, "FLAG_": wire.Flag, "REASON_": wire.Reason}
SCALARS = ("MAGIC", "VERSION", "HEADER_LEN", "TAG_LEN", "DEFAULT_PORT", "MAX_NCHUNKS", "MAX_PRIO", "TOL_SCALE",
           "DST_ALL")


def python_constants() -> dict[str, int]:
    """Every constant the Python side defines, under its C macro name."""
    out = {f"DBLP_{n}": int(getattr(wire, n)) for n in SCALARS}
    for prefix, members in ENUMS.items():
        for m in members:
            out[f"DBLP_{prefix}{m.name}"] = int(m)
    return out


# Python modules that mirror parts of dblp.h: the header (wire) and the maps
# of the host program.  A macro DBLP_<X> is mirrored by attribute <X> or by
# member <R> of an int enum named like <P> where X = P_R (DBLP_KIND_DATA ->
# Kind.DATA, DBLP_JOB_TRANSPORT_XSK -> JobTransport.XSK).
MIRRORS = ("pydblp.wire", "pydblp.host", "pydblp.bpf")


def python_twin(cname: str) -> tuple[int | None, str]:
    """The value a Python mirror gives macro ``cname``, or None and why not."""
    x = cname[len("DBLP_"):]
    errors = []
    for modname in MIRRORS:
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name == modname:  # that mirror is not written (yet)
                continue
            errors.append(f"{modname}: {type(e).__name__}: {e}")
            continue
        except Exception as e:  # a mirror that does not import cannot mirror anything
            errors.append(f"{modname}: {type(e).__name__}: {e}")
            continue
        value = getattr(mod, x, None)
        if isinstance(value, int):
            return int(value), ""
        for i in (i for i, ch in enumerate(x) if ch == "_"):
            prefix, member = x[:i].replace("_", ""), x[i + 1:]
            for obj in vars(mod).values():
                if (isinstance(obj, type) and issubclass(obj, enum.Enum) and obj.__name__.upper() == prefix
                        and member in obj.__members__):
                    return int(obj[member]), ""
    return None, "; ".join(errors)


def python_fields() -> list[tuple[str, int]]:
    return [(name, struct.calcsize("!" + code)) for name, code in wire.FIELDS]


def parse_header(text: str) -> tuple[list[str], list[str]]:
    """Object-like ``DBLP_*`` macros with a value, and the members of struct dblp_hdr."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    macros = re.findall(r"^\s*#\s*define\s+(DBLP_\w+)[ \t]+\S", text, flags=re.M)
    body = re.search(r"struct\s+dblp_hdr\s*\{(.*?)\}", text, flags=re.S)
    assert body, "struct dblp_hdr not found in dblp.h"
    members = [re.findall(r"(\w+)\s*(?:\[[^\]]*\])?\s*$", decl.strip())[0]
               for decl in body.group(1).split(";") if decl.strip()]
    return macros, members


def c_program(macros: list[str], members: list[str]) -> str:
    """Print every macro and member the two sides name, marking the ones C lacks."""
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "dblp.h"',
             "#define M(s, m) (((struct dblp_hdr *)0)->m)", "int main(void) {",
             '  printf("sizeof %zu\\n", sizeof(struct dblp_hdr));']
    for m in members:
        # offset, size, and whether the type is unsigned
        lines.append(f'  printf("field {m} %zu %zu %d\\n", offsetof(struct dblp_hdr, {m}), '
                     f"sizeof(M(s, {m})), (__typeof__(M(s, {m})))-1 > 0);")
    for name in macros:
        lines += [f"#ifdef {name}", f'  printf("const {name} %lld\\n", (long long)({name}));',
                  "#else", f'  printf("const {name} missing\\n");', "#endif"]
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


def run_c(header: Path, macros: list[str], members: list[str], tmp: Path) -> tuple[int, dict, dict]:
    src, exe = tmp / "agree.c", tmp / "agree"
    src.write_text(c_program(macros, members))
    cc = subprocess.run([GCC, "-std=gnu11", "-Wall", "-Werror", "-I", str(header.parent),
                         "-o", str(exe), str(src)], capture_output=True, text=True)
    if cc.returncode:
        return -1, {"compile error": cc.stderr.strip().splitlines()[:5]}, {}
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    size, consts, fields = 0, {}, {}
    for line in out.splitlines():
        kind, *rest = line.split()
        if kind == "sizeof":
            size = int(rest[0])
        elif kind == "field":
            fields[rest[0]] = tuple(int(x) for x in rest[1:])
        else:
            consts[rest[0]] = None if rest[1] == "missing" else int(rest[1])
    return size, consts, fields


def disagreements(header: Path, tmp: Path, constants: dict[str, int] | None = None,
                  fields: list[tuple[str, int]] | None = None) -> list[str]:
    """Every way ``header`` and the Python definitions differ, as readable lines."""
    constants = python_constants() if constants is None else constants
    fields = python_fields() if fields is None else fields
    c_macros, c_members = parse_header(header.read_text())
    problems = []
    # C -> Python: nothing defined in C alone
    extra = {}
    for m in c_macros:
        if m in constants:
            continue
        extra[m], why = python_twin(m)
        if extra[m] is None:
            names = ", ".join(MIRRORS)
            problems.append(f"{m} is in dblp.h but in no Python mirror ({names})" + (f" [{why}]" if why else ""))
    py_names = [n for n, _ in fields]
    problems += [f"struct member {m} is in dblp.h but not in wire.FIELDS" for m in c_members if m not in py_names]
    if [m for m in c_members if m in py_names] != [n for n in py_names if n in c_members]:
        problems.append(f"member order differs: C {c_members} vs Python {py_names}")
    # Python -> C: compile the Python names against the header
    names = sorted(set(constants) | set(c_macros))
    size, c_consts, c_fields = run_c(header, names, [n for n in py_names if n in c_members], tmp)
    if size == -1:
        return problems + [f"dblp.h does not compile: {c_consts['compile error']}"]
    if size != wire.HEADER_LEN or size != sum(s for _, s in fields):
        problems.append(f"sizeof(struct dblp_hdr) = {size}, Python header is {sum(s for _, s in fields)}")
    offset = 0
    for name, width in fields:
        if name not in c_fields:
            problems.append(f"wire.FIELDS has {name}, struct dblp_hdr does not")
        else:
            c_off, c_size, unsigned = c_fields[name]
            if (c_off, c_size) != (offset, width):
                problems.append(f"{name}: C offset/size {c_off}/{c_size}, Python {offset}/{width}")
            if not unsigned:
                problems.append(f"{name}: C type is signed, the wire field is unsigned")
        offset += width
    for name, value in list(constants.items()) + [(k, v) for k, v in extra.items() if v is not None]:
        if c_consts.get(name) is None:
            problems.append(f"{name} is in wire.py but not defined in dblp.h")
        elif c_consts[name] != value:
            problems.append(f"{name}: C {c_consts[name]:#x}, Python {value:#x}")
    return problems


def test_c_and_python_agree(tmp_path):
    assert disagreements(HEADER, tmp_path) == []


def test_parser_sees_the_whole_header():
    # guards the parser itself: every Python name is found by parsing the file
    macros, members = parse_header(HEADER.read_text())
    assert set(python_constants()) <= set(macros)
    assert members == [n for n, _ in wire.FIELDS]


# ---- the check fails when one side changes alone -------------------------------

def _mutated(tmp: Path, old: str, new: str) -> Path:
    text = HEADER.read_text()
    assert old in text, f"mutation anchor {old!r} not in dblp.h"
    path = tmp / "inc" / "dblp.h"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize("old,new,expect", [
    ("#define DBLP_MAGIC", "#define DBLP_MAGIC 0xDB1C //", "DBLP_MAGIC: C"),
    ("#define DBLP_REASON_TAG", "#define DBLP_REASON_XYZ 12\n#define DBLP_REASON_TAG", "DBLP_REASON_XYZ is in dblp.h but in no Python mirror"),
    ("#define DBLP_KIND_HELLO", "#define DBLP_KIND_HELLOX", "DBLP_KIND_HELLO is in wire.py but not"),
    ("__u16 len;", "__u32 len;", "len: C offset/size"),
    ("__u16 len;", "__s16 len;", "len: C type is signed"),
    ("__u8  flags;", "__u8  flags;\n\t__u8  pad;", "struct member pad"),
    ("__u16 src;\n\t__u16 dst;", "__u16 dst;\n\t__u16 src;", "member order differs"),
])
def test_c_change_alone_fails(tmp_path, old, new, expect):
    problems = disagreements(_mutated(tmp_path, old, new), tmp_path)
    assert any(expect in p for p in problems), problems


def test_python_change_alone_fails(tmp_path):
    consts = python_constants()
    consts["DBLP_KIND_EXTRA"] = 6
    assert any("DBLP_KIND_EXTRA is in wire.py" in p for p in disagreements(HEADER, tmp_path, constants=consts))
    consts = python_constants()
    consts["DBLP_DEFAULT_PORT"] += 1
    assert any("DBLP_DEFAULT_PORT: C" in p for p in disagreements(HEADER, tmp_path, constants=consts))
    fields = [(n, 4 if n == "tensor" else s) for n, s in python_fields()]
    assert any("sizeof(struct dblp_hdr)" in p for p in disagreements(HEADER, tmp_path, fields=fields))
    fields = python_fields() + [("extra", 1)]
    assert any("wire.FIELDS has extra" in p for p in disagreements(HEADER, tmp_path, fields=fields))


# ---- the host program's map structs (pydblp.host.STRUCTS) ----------------------

def struct_layout(header: Path, tmp: Path, structs: dict) -> dict[str, tuple[int, dict]]:
    """sizeof and (offset, size) per member of each named struct, compiled from ``header``."""
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "dblp.h"', "int main(void) {"]
    for name, members in structs.items():
        lines.append(f'  printf("{name} sizeof %zu\\n", sizeof(struct {name}));')
        for m, _ in members:
            lines.append(f'  printf("{name} {m} %zu %zu\\n", offsetof(struct {name}, {m}), '
                         f"sizeof(((struct {name} *)0)->{m}));")
    lines += ["  return 0;", "}"]
    src, exe = tmp / "structs.c", tmp / "structs"
    src.write_text("\n".join(lines) + "\n")
    cc = subprocess.run([GCC, "-std=gnu11", "-I", str(header.parent), "-o", str(exe), str(src)],
                        capture_output=True, text=True)
    assert cc.returncode == 0, cc.stderr
    out: dict[str, tuple[int, dict]] = {}
    for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines():
        name, m, *vals = line.split()
        size, members = out.get(name, (0, {}))
        if m == "sizeof":
            out[name] = (int(vals[0]), members)
        else:
            members[m] = (int(vals[0]), int(vals[1]))
            out[name] = (size, members)
    return out


def struct_disagreements(header: Path, tmp: Path, structs: dict) -> list[str]:
    text = re.sub(r"/\*.*?\*/", "", header.read_text(), flags=re.S)
    problems = []
    for name, members in structs.items():
        body = re.search(rf"struct\s+{name}\s*\{{(.*?)\}}", text, flags=re.S)
        if not body:
            problems.append(f"struct {name} not in dblp.h")
            continue
        c_members = [re.findall(r"(\w+)\s*(?:\[[^\]]*\])?\s*$", d.strip())[0]
                     for d in body.group(1).split(";") if d.strip()]
        if c_members != [m for m, _ in members]:
            problems.append(f"struct {name}: C members {c_members}, Python {[m for m, _ in members]}")
    if problems:
        return problems
    layout = struct_layout(header, tmp, structs)
    for name, members in structs.items():
        size, c = layout[name]
        py_size = struct.calcsize("=" + "".join(code for _, code in members))
        if size != py_size:
            problems.append(f"sizeof(struct {name}) = {size}, Python {py_size}")
        off = 0
        for m, code in members:
            width = struct.calcsize("=" + code)
            if c[m] != (off, width):
                problems.append(f"{name}.{m}: C offset/size {c[m]}, Python {(off, width)}")
            off += width
    return problems


def test_host_map_structs_agree(tmp_path):
    from pydblp import host

    assert struct_disagreements(HEADER, tmp_path, host.STRUCTS) == []


def test_host_struct_change_alone_fails(tmp_path):
    from pydblp import host

    hdr = _mutated(tmp_path, "__u32 rate_pps;", "__u64 rate_pps;")
    assert any("dblp_host_cfg" in p for p in struct_disagreements(hdr, tmp_path, host.STRUCTS))
    changed = dict(host.STRUCTS, dblp_job=(("world_size", "I"), ("rank", "H"), ("transport", "B"), ("pad", "3x")))
    assert any("dblp_job" in p for p in struct_disagreements(HEADER, tmp_path, changed))


CSRC_HEADER = Path(__file__).resolve().parents[2] / "pydblp" / "csrc" / "wire.h"
# csrc/wire.h macro -> its value in wire.py (the compiled loops' copy of the header's constants)
CSRC_CONSTANTS = {"HEADER_LEN": wire.HEADER_LEN, "TAG_LEN": wire.TAG_LEN, "MAGIC": wire.MAGIC,
                  "VERSION": wire.VERSION, "KIND_MIN": min(wire.Kind), "KIND_MAX": max(wire.Kind),
                  "KIND_DATA": wire.Kind.DATA, "DTYPE_F32": wire.Dtype.F32, "MAX_NCHUNKS": wire.MAX_NCHUNKS,
                  "FLAG_ALLGATHER": wire.Flag.ALLGATHER, "FLAG_TAG": wire.Flag.TAG, "DST_ALL": wire.DST_ALL}


def test_the_compiled_loops_header_agrees_with_wire_py(tmp_path):
    """pydblp/csrc/wire.h (the header the compiled per-packet loops include) defines exactly
    the constants above, each with wire.py's value: compiled and printed, not restated."""
    text = re.sub(r"/\*.*?\*/", "", CSRC_HEADER.read_text(), flags=re.S)
    defined = set(re.findall(r"^\s*#\s*define\s+(\w+)[ \t]+\S", text, flags=re.M))
    assert defined == set(CSRC_CONSTANTS), defined ^ set(CSRC_CONSTANTS)
    src, exe = tmp_path / "csrc_agree.c", tmp_path / "csrc_agree"
    src.write_text("#include <stdio.h>\n#include \"wire.h\"\nint main(void) {\n"
                   + "".join(f'  printf("{n} %lld\\n", (long long)({n}));\n' for n in CSRC_CONSTANTS)
                   + "  return 0;\n}\n")
    subprocess.run([GCC, "-std=gnu11", "-Wall", "-Werror", "-I", str(CSRC_HEADER.parent), "-o", str(exe), str(src)],
                   check=True, capture_output=True)
    out = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                      check=True).stdout.splitlines())
    assert {k: int(v) for k, v in out.items()} == {k: int(v) for k, v in CSRC_CONSTANTS.items()}
