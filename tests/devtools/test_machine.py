"""The machine line of the test session's header and of benchmark metadata."""

from __future__ import annotations

from worker.devtools.machine import Machine, parse_cpuinfo, this_machine

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx avx2 fma bmi2 sha_ni
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx avx2 fma bmi2 sha_ni
"""
SAPPHIRE = """model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: avx avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def test_the_instruction_sets_are_read_from_cpuinfo() -> None:
    assert parse_cpuinfo(EPYC) == ("AMD EPYC 7B13", ("avx2", "fma"))
    model, sets = parse_cpuinfo(SAPPHIRE)
    assert model.startswith("Intel(R) Xeon(R)")
    assert sets == ("amx_bf16", "amx_int8", "amx_tile", "avx2", "avx512_bf16", "avx512bw",
                    "avx512f", "fma")  # fmt: skip
    assert parse_cpuinfo("") == ("?", ())


def test_this_machine_names_itself() -> None:
    here = this_machine()
    assert here.cores >= 1 and here.cpu_model
    line = here.describe()
    assert here.torch_cpu_capability in line and f"{here.cores} cores" in line
    assert Machine("X", (), "AVX2", 2, (0.5, 0, 0)).describe() == (
        "X; no AVX/AMX/SVE flags; torch AVX2; 2 cores; load 0.50"
    )
