"""`python -m kvledger.bench.ncu_stalls REPORT.csv[.xz] [--top N]`: where a kernel's warps wait.

Reads the per-instruction source page of an Nsight Compute report, exported on the GPU machine with
`ncu --import R.ncu-rep --page source --csv --print-source sass > R.csv` (it may be xz-compressed),
and prints for each kernel in it:

- the warp stall samples by reason (ncu's `stall_*` columns, summed over the kernel's instructions);
- the instructions with the most samples, each with its top three reasons and how often it ran;
- the instruction mix: warp-level instructions executed, by opcode with its modifiers.

ncu's own details page gives a kernel's averages; this is the per-instruction view behind them
(which load a barrier waits for, whether spills' reloads sit on the critical path), in text that
can be saved under results/ and read without the Nsight GUI.
"""

from __future__ import annotations

import argparse
import csv
import io
import lzma
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Instruction:
    address: str
    source: str
    samples: int
    executed: int
    stalls: Dict[str, int]  # reason (without the stall_ prefix) -> samples

    @property
    def opcode(self) -> str:
        """The opcode with its modifiers, a predicate guard dropped (`@!P0 LDS.U8 ...` -> `LDS.U8`)."""
        words = self.source.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        return words[0] if words else "?"


@dataclass
class KernelStalls:
    name: str
    instructions: List[Instruction] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(i.samples for i in self.instructions)

    @property
    def executed(self) -> int:
        return sum(i.executed for i in self.instructions)

    def reasons(self) -> Counter:
        total: Counter = Counter()
        for ins in self.instructions:
            total.update(ins.stalls)
        return total

    def mix(self) -> Counter:
        mix: Counter = Counter()
        for ins in self.instructions:
            mix[ins.opcode] += ins.executed
        return mix

    def lines(self, top: int = 15, mix: int = 25) -> List[str]:
        samples = max(1, self.samples)
        out = [f"kernel {self.name}: {len(self.instructions):,} SASS instructions, {self.samples:,} stall samples, "]
        out[0] += f"{self.executed:,} warp instructions executed"
        out.append("  stall reasons (share of samples):")
        for reason, n in self.reasons().most_common():
            if n:
                out.append(f"    {reason:20s} {n:8,d}  {100 * n / samples:5.1f}%")
        out.append(f"  top {top} instructions by samples (address, instruction, samples, times executed, top reasons):")
        for ins in sorted(self.instructions, key=lambda i: -i.samples)[:top]:
            reasons = ", ".join(f"{r} {n}" for r, n in Counter(ins.stalls).most_common(3) if n)
            out.append(
                f"    {ins.address[-6:]:>6s}  {ins.source[:58]:58s} {ins.samples:6d} {ins.executed:10,d}  {reasons}"
            )
        executed = max(1, self.executed)
        out.append(f"  instruction mix (top {mix}, share of warp instructions executed):")
        for opcode, n in self.mix().most_common(mix):
            out.append(f"    {opcode:32s} {n:12,d}  {100 * n / executed:5.1f}%")
        return out


def _int(text: str) -> int:
    return int(text.replace(",", "")) if text.strip() else 0


def parse(text: str) -> List[KernelStalls]:
    """The kernels of an ncu source-page CSV export, in the report's order."""
    kernels: List[KernelStalls] = []
    columns: Dict[str, int] = {}
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            kernels.append(KernelStalls(row[1] if len(row) > 1 else "?"))
            columns = {}
        elif row[0] == "Address":
            columns = {name: i for i, name in enumerate(row)}
            missing = [c for c in (SAMPLES, EXECUTED, "Source") if c not in columns]
            if missing:
                raise ValueError(f"not an ncu source page with SASS and stall sampling: no column {missing[0]!r}")
        elif columns and kernels:
            stalls = {
                name[len("stall_") :]: _int(row[i])
                for name, i in columns.items()
                if name.startswith("stall_") and "Not Issued" not in name
            }
            kernels[-1].instructions.append(
                Instruction(
                    row[0],
                    row[columns["Source"]].strip(),
                    _int(row[columns[SAMPLES]]),
                    _int(row[columns[EXECUTED]]),
                    stalls,
                )  # fmt: skip
            )
    if not kernels or not any(k.instructions for k in kernels):
        raise ValueError("no kernel with SASS rows: export with --page source --csv --print-source sass")
    return kernels


def read(path: Path) -> str:
    data = path.read_bytes()
    return (lzma.decompress(data) if path.suffix == ".xz" else data).decode("utf-8", errors="replace")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvledger.bench.ncu_stalls", description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path, help="ncu --page source --csv --print-source sass output (.csv or .csv.xz)")
    p.add_argument("--top", type=int, default=15, help="instructions to list by stall samples (default 15)")
    args = p.parse_args(argv)
    try:
        kernels = parse(read(args.report))
    except (OSError, ValueError, lzma.LZMAError) as e:
        print(f"python -m kvledger.bench.ncu_stalls: {args.report}: {e}", file=sys.stderr)
        return 2
    for kernel in kernels:
        print("\n".join(kernel.lines(args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
