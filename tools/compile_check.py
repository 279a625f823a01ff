"""The fused kernels compiled for real GPUs, without a GPU: every launch the fused path
makes, each specialization built for sm_80 and sm_90, registers, spills and fp64 work read
from the result.

Launches are recorded, not listed (``compile_launches``): :func:`record` drives ``largebatch.torch.LARS`` /
``LAMB(..., fused=True)`` and the functionals ``lars`` / ``lamb`` over
:func:`configurations` (the five param kinds, aligned and unaligned tensors, every launch
shape, GradScaler's ``grad_scale`` / ``found_inf``, LAMB's ``max_grad_norm``, the optimizer's
step counter, the flag hyperparameters) and records what each ``@triton.jit`` kernel of
``common.py``, ``lars.py`` and ``lamb.py`` is launched with, as triton specializes it
(:class:`Launch`: constexprs, argument types, which pointer and integer arguments are
16-divisible, launch options). That needs the interpreter (the fused path runs on the CPU
only under ``TRITON_INTERPRET=1``) but not the kernels themselves: the host decides every
launch from host values (addresses, sizes, dtypes, flags) and reads nothing back, so the
recorder does not run them.

:func:`measure` compiles one launch with triton's compiler for one target (no interpreter,
no GPU) and reads, per specialization (:class:`Measure`):

- registers per thread and spill bytes, from the ptxas log of the compile;
- the fp64 instructions per element of the tile loops, counted on the PTX. The TTGIR says
  which operations run once per element: those on tensors inside a tile loop (an
  ``scf.for``). An fp64 instruction of the PTX (one with an ``f64`` type) counts when its
  ``.loc`` is the source location of such an fp64 operation; the count is divided by the
  elements a thread handles over every copy of the tile loops in the PTX (the bytes of its
  masked global loads, over the bytes the loop loads per element). Scalar work (a tile's
  sum taken into fp64, a norm, a bias correction) runs once per tile or per program and is
  counted apart: ``fp64 other``, every other fp64 instruction of the PTX. So are the fp64
  additions of ``finish_kernel`` (:data:`ACROSS_TILES`), whose loop runs over the chunks'
  partial sums, one per chunk of up to 4,096 elements, not over elements;
- the widest masked global load (16 bytes where the addresses are aligned).

``python tools/compile_check.py`` (``make check-kernels``) records in a
subprocess with the interpreter, compiles every specialization for sm_80 and sm_90, prints
a table per kernel and target and exits with status 1 on a violation: a spill, more than
:data:`MAX_REGISTERS` registers, an fp64 instruction per element, aligned tile loads
narrower than 16 bytes (or wider than an element when unaligned), a failed compile.
``--quick`` takes a small sample (``make test`` runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from compile_launches import (
    KERNEL_MODULES,
    Launch,
    configurations,
    decode,
    record,
)

ARCHS = (80, 90)
MAX_REGISTERS = 128  # a thread's: 4 warps then hold 16K of an SM's 64K registers

# ----------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Measure:
    """What one compiled specialization uses (see the module docstring for the counts)."""

    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    fp64_per_element: float  # in the tile loops
    fp64_other: int  # fp64 instructions elsewhere
    load_bytes: int  # widest masked global load (the tile loops'; 0: none)
    elements: int  # elements per thread over every copy of the tile loops in the PTX

    @property
    def spills(self) -> int:
        return max(self.spill_stores, self.spill_loads)


_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_usage(log: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from a ``ptxas -v`` log of one kernel."""
    registers = _REGISTERS.findall(log)
    spills = _SPILLS.findall(log)
    if len(registers) != 1 or len(spills) != 1:
        raise ValueError(f"expected one kernel's usage in the ptxas log:\n{log}")
    return int(registers[0]), int(spills[0][0]), int(spills[0][1])


_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
_LOC_USE = re.compile(r"loc\((#loc\d*|.*)\)\s*$")
_FILE_LOC = re.compile(r'^"([^"]+)":(\d+):(\d+)$')
_NAMED_LOC = re.compile(r'^"[^"]*"\((.*)\)$')
_CALLSITE = re.compile(r"^callsite\((\S+) at (\S+)\)$")
_F64_TENSOR = re.compile(r"tensor<[^>]*xf64\b")
_LOAD_TYPE = re.compile(r"tensor<[^>]*x!tt\.ptr<(\w+)>")
_BITS = {"f32": 32, "f16": 16, "bf16": 16, "f64": 64, "i64": 64, "i32": 32}

Loc = tuple[str, int, int]  # (file name, line, column)


def _resolve(text: str, table: dict[str, str], depth: int = 0) -> Loc | None:
    """The innermost file location of an MLIR location (named, call site, or file)."""
    text = text.strip()
    if depth > 50:
        return None
    if text.startswith("#loc"):
        return _resolve(table[text], table, depth + 1) if text in table else None
    if m := _FILE_LOC.match(text):
        return os.path.basename(m.group(1)), int(m.group(2)), int(m.group(3))
    if m := _NAMED_LOC.match(text):
        return _resolve(m.group(1), table, depth + 1)
    if m := _CALLSITE.match(text):
        return _resolve(m.group(1), table, depth + 1) or _resolve(m.group(2), table, depth + 1)
    if text.startswith("fused"):
        for part in re.findall(r"#loc\d*", text):
            if loc := _resolve(part, table, depth + 1):
                return loc
    return None


def tile_loop_sites(ttgir: str) -> tuple[set[Loc], int]:
    """From a TTGIR: the source locations of the fp64 tensor operations inside ``scf.for``
    loops (the tile loops), and the bytes that the first such loop loads per element."""
    table = {}
    for line in ttgir.splitlines():
        if m := _LOC_DEF.match(line.strip()):
            table[m.group(1)] = m.group(2)
    sites: set[Loc] = set()
    load_bytes = 0
    first_loop_done = False
    depth = 0  # of braces
    loops: list[int] = []  # the depth inside each open scf.for
    for line in ttgir.splitlines():
        text = line.strip()
        if loops and not text.startswith(("scf.yield", "scf.for", "tt.reduce.return")):
            use = _LOC_USE.search(text)
            loc = _resolve(use.group(1), table) if use else None
            if loc is not None and _F64_TENSOR.search(text.split(" loc(")[0]):
                sites.add(loc)
            if not first_loop_done and " = tt.load " in f" {text}":
                if m := _LOAD_TYPE.search(text):
                    load_bytes += _BITS[m.group(1)] // 8
        if "scf.for" in text and text.endswith("{"):
            loops.append(depth + 1)
        depth += text.count("{") - text.count("}")
        while loops and depth < loops[-1]:
            loops.pop()
            first_loop_done = first_loop_done or load_bytes > 0
    return sites, load_bytes


_PTX_FILE = re.compile(r'^\.file\s+(\d+)\s+"([^"]+)"')
_PTX_LOC = re.compile(r"^\.loc\s+(\d+)\s+(\d+)\s+(\d+)")


def count_fp64(ptx: str, sites: set[Loc], bytes_per_element: int) -> tuple[float, int, int, int]:
    """(fp64 instructions per element at ``sites``, fp64 instructions elsewhere, widest
    masked global load in bytes, elements per thread that the masked loads cover) of a
    PTX. Masked (predicated) global loads are the tile loops' loads: their bytes over
    ``bytes_per_element`` count the elements of every copy of the loops in the PTX."""
    files = {
        m.group(1): os.path.basename(m.group(2))  # .file comes after the code
        for m in map(_PTX_FILE.match, (x.strip() for x in ptx.splitlines()))
        if m
    }
    loc: Loc | None = None
    per_element = other = loaded = widest = 0
    for line in ptx.splitlines():
        text = line.split("//")[0].strip()
        if m := _PTX_LOC.match(text):
            loc = (files.get(m.group(1), "?"), int(m.group(2)), int(m.group(3)))
            continue
        if not text or text.startswith((".", "$", "{", "}")):
            continue
        predicated = text.startswith("@")
        opcode = text.split()[1] if predicated else text.split()[0]
        parts = opcode.rstrip(";").split(".")
        if "f64" in parts:
            if loc in sites:
                per_element += 1
            else:
                other += 1
        if parts[0] == "ld" and "global" in parts and predicated:
            vector = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d+", p)), 1)
            size = vector * int(re.sub(r"\D", "", parts[-1]) or 0) // 8
            loaded += size
            widest = max(widest, size)
    elements = loaded // bytes_per_element if bytes_per_element else 0
    return (per_element / elements if elements else float(per_element)), other, widest, elements


def measure(launch: Launch, arch: int, options: dict[str, Any] | None = None) -> Measure:
    """Compile ``launch`` for ``sm_<arch>`` (CUDA, no GPU needed) and measure the result.

    ``options`` add to the launch's own (e.g. ``maxnreg``). Needs the kernels defined
    without the interpreter (``TRITON_INTERPRET`` unset when triton was imported).
    """
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    fn = launch.function()
    if not hasattr(fn, "params"):
        raise RuntimeError("measure() needs the kernels compiled, not interpreted: unset TRITON_INTERPRET")
    signature = dict(launch.signature)
    constexprs = {name: decode(v) for name, v in launch.constexprs}
    attrs = {(fn.arg_names.index(name),): CUDABackend.parse_attr("D") for name in launch.attrs}
    source = ASTSource(fn, signature, constexprs, attrs)
    log = io.StringIO()
    with (
        tempfile.TemporaryDirectory() as cache,
        knobs.cache.scope(),
        knobs.compilation.scope(),
        knobs.nvidia.scope(),
    ):
        knobs.cache.dir = cache
        knobs.compilation.always_compile = True  # ptxas runs, and logs
        knobs.nvidia.dump_ptxas_log = True  # printed on stdout
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(
                source,
                target=GPUTarget("cuda", arch, 32),
                options={**dict(launch.options), **(options or {})},
            )
    registers, stores, loads = ptxas_usage(log.getvalue())
    sites, bytes_per_element = tile_loop_sites(kernel.asm["ttgir"])
    if launch.name in ACROSS_TILES:
        sites, bytes_per_element = set(), 0
    per_element, other, widest, elements = count_fp64(kernel.asm["ptx"], sites, bytes_per_element)
    return Measure(registers, stores, loads, per_element, other, widest, elements)


# Kernels whose loops add the chunks' fp64 partial sums: fp64 by design, once per chunk.
ACROSS_TILES = frozenset({"finish_kernel"})

_TL_TO_MLIR = {"fp32": "f32", "fp16": "f16", "bf16": "bf16", "fp64": "f64"}


def violations(launch: Launch, m: Measure) -> list[str]:
    """What is wrong with one measured specialization (nothing: an empty list)."""
    out = []
    if m.spills:
        out.append(f"spills {m.spill_stores} B stored / {m.spill_loads} B loaded")
    if m.registers > MAX_REGISTERS:
        out.append(f"{m.registers} registers a thread (> {MAX_REGISTERS})")
    if m.fp64_per_element:
        out.append(f"{m.fp64_per_element:g} fp64 instructions per element")
    values = dict(launch.constexprs)
    if m.elements and "ALIGNED" in values:
        dtypes = [values[k] for k in ("P_DTYPE", "W_DTYPE") if k in values]
        elem_bytes = min(_BITS[_TL_TO_MLIR[d]] for d in dtypes) // 8
        per_thread = values["BLOCK"] // (32 * dict(launch.options).get("num_warps", 4))
        if values["ALIGNED"] and m.load_bytes < min(16, per_thread * elem_bytes):
            out.append(f"aligned, yet {m.load_bytes}-byte tile loads")
        if not values["ALIGNED"] and m.load_bytes > 4:
            out.append(f"unaligned, yet {m.load_bytes}-byte tile loads")
    return out


def _measure_job(job: tuple[dict[str, Any], int]) -> tuple[Measure | None, str]:
    """A worker's job: one launch (as JSON) for one arch; (measure, error)."""
    launch, arch = Launch.from_json(job[0]), job[1]
    try:
        return measure(launch, arch), ""
    except Exception as e:  # noqa: BLE001 - a failed compile is a violation to report
        return None, f"{type(e).__name__}: {e}"[:2000]


# ----------------------------------------------------------------------------- the check


def record_in_subprocess(quick: bool) -> list[Launch]:
    """:func:`record` over :func:`configurations` in a subprocess with the interpreter on."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "launches.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--record", out]
        cmd += ["--quick"] if quick else []
        run = subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"recording the launches failed:\n{run.stderr[-4000:]}")
        with open(out) as f:
            return [Launch.from_json(d) for d in json.load(f)]


@dataclass
class Row:
    """One line of the table: a kernel on one target."""

    kernel: str
    arch: int
    specializations: int = 0
    max_registers: int = 0
    spilling: int = 0  # specializations that spill
    max_spill: int = 0
    fp64_per_element: float = 0.0  # the largest
    fp64_other: int = 0  # the largest
    failed: int = 0


def table(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table."""
    head = (
        "kernel",
        "target",
        "specializations",
        "max registers",
        "spilling (max B)",
        "fp64 / element",
        "fp64 other (max)",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = (
            f"`{r.kernel}`",
            f"sm_{r.arch}",
            f"{r.specializations}" + (f" ({r.failed} failed)" if r.failed else ""),
            str(r.max_registers),
            f"{r.spilling} ({r.max_spill})",
            f"{r.fp64_per_element:g}",
            str(r.fp64_other),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check(
    launches: Sequence[Launch], archs: Sequence[int], jobs: int, verbose: bool = False
) -> tuple[list[Row], list[str]]:
    """Measure every launch on every arch (``jobs`` processes); the table's rows and the
    violations, one line each."""
    work = [(launch.to_json(), arch) for arch in archs for launch in launches]
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("the compile check needs TRITON_INTERPRET unset (it compiles the kernels)")
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        results = list(pool.map(_measure_job, work, chunksize=4))
    rows: dict[tuple[str, int], Row] = {}
    problems = []
    for (launch_json, arch), (m, error) in zip(work, results):
        launch = Launch.from_json(launch_json)
        row = rows.setdefault((launch.name, arch), Row(launch.name, arch))
        row.specializations += 1
        where = f"sm_{arch} {launch.name} {launch.label()}"
        if m is None:
            row.failed += 1
            problems.append(f"{where}: does not compile: {error}")
            continue
        row.max_registers = max(row.max_registers, m.registers)
        row.spilling += m.spills > 0
        row.max_spill = max(row.max_spill, m.spills)
        row.fp64_per_element = max(row.fp64_per_element, m.fp64_per_element)
        row.fp64_other = max(row.fp64_other, m.fp64_other)
        problems += [f"{where}: {v}" for v in violations(launch, m)]
        if verbose:
            print(f"{where}: {m}")
    module = {x.name: KERNEL_MODULES.index(x.kernel.rsplit(":", 1)[0]) for x in launches}
    return sorted(rows.values(), key=lambda r: (r.arch, module[r.kernel], r.kernel)), problems


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python tools/compile_check.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a sample of the configurations")
    parser.add_argument(
        "--arch",
        type=int,
        nargs="+",
        default=list(ARCHS),
        help="compute capabilities to compile for (default: 80 90)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument("--verbose", action="store_true", help="print every specialization")
    parser.add_argument("--record", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.record:  # the subprocess of record_in_subprocess
        launches = record(configurations(args.quick))
        with open(args.record, "w") as f:
            json.dump([x.to_json() for x in launches], f)
        return 0
    launches = record_in_subprocess(args.quick)
    rows, problems = check(launches, args.arch, max(1, args.jobs), args.verbose)
    print(
        f"{len(launches)} specializations recorded, compiled for " + ", ".join(f"sm_{a}" for a in args.arch)
    )
    print(table(rows))
    for p in problems:
        print(p)
    print(f"{len(problems)} violations" if problems else "no violations")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
