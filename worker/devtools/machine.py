"""The machine a test run or a figure comes from: CPU model, its vector instruction sets,
torch's CPU kernel level, cores and load.

Results on this project's CPUs differ by instruction set (torch's compiled CPU flex kernel is
wrong on AVX2-only CPUs: ``worker.executor.flex``), so the test session's header and every
benchmark's metadata name them. Linux reads ``/proc/cpuinfo``; elsewhere the fields are
``"?"``/empty.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

# the instruction-set families that change which kernels run (x86 AVX/AMX, Arm SVE/NEON)
_SETS = re.compile(r"^(avx2|avx512[a-z0-9_]*|amx[a-z0-9_]*|sve[a-z0-9_]*|asimd|neon|fma)$")


@dataclass(frozen=True)
class Machine:
    """What a figure or a test failure names about its machine."""

    cpu_model: str
    instruction_sets: tuple[str, ...]  # sorted, e.g. ("avx2", "fma")
    torch_cpu_capability: str  # torch's dispatch level ("AVX2", "AVX512", ...), "?" without torch
    cores: int
    load_average: tuple[float, float, float]

    def describe(self) -> str:
        """One line: ``AMD EPYC ...; avx2 fma; torch AVX2; 2 cores; load 0.52``."""
        sets = " ".join(self.instruction_sets) or "no AVX/AMX/SVE flags"
        return (
            f"{self.cpu_model}; {sets}; torch {self.torch_cpu_capability}; "
            f"{self.cores} cores; load {self.load_average[0]:.2f}"
        )


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """``(model name, instruction sets)`` from the text of ``/proc/cpuinfo`` (the first CPU's
    ``model name`` and ``flags``/``Features`` line)."""
    model, flags = "?", ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "CPU part") and model == "?":
            model = value.strip() or "?"
        elif key in ("flags", "Features") and not flags:
            flags = value
    return model, tuple(sorted({f for f in flags.split() if _SETS.match(f)}))


def _torch_capability() -> str:
    try:
        import torch
    except ImportError:
        return "?"
    return str(torch.backends.cpu.get_cpu_capability())


def this_machine() -> Machine:
    """The machine this process runs on."""
    try:
        model, sets = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        model, sets = platform.processor() or "?", ()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return Machine(model, sets, _torch_capability(), os.cpu_count() or 0, load)
