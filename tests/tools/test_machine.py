"""The CPU a figure ran on: its name, family, model and vector extensions (minicb/bench/machine.py)."""
from minicb.bench.machine import cpu_model, describe_cpuinfo

ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx fma avx2 bmi2
processor\t: 1
model name\t: AMD EPYC
"""

XEON = """processor\t: 0
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx avx2 avx512f avx512bw amx_bf16 amx_tile amx_int8
"""


def test_two_cpus_of_one_name_are_told_apart_by_family_model_and_vector_width():
    assert describe_cpuinfo(ZEN3) == "AMD EPYC (family 25, model 1; AVX2)"
    assert describe_cpuinfo(XEON) == "Intel(R) Xeon(R) Processor (family 6, model 143; AVX-512, AMX)"


def test_a_cpuinfo_without_a_model_name_gives_none_and_a_bare_name_stays_bare():
    assert describe_cpuinfo("processor\t: 0\nflags\t\t: avx2\n") is None
    assert describe_cpuinfo("model name\t: Some CPU\n") == "Some CPU"


def test_this_machines_cpu_is_named():
    assert cpu_model().strip()
