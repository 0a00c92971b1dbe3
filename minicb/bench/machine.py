"""What a figure was measured on: the CPU's model, printed beside every benchmark's numbers.

Speeds on a CPU depend on its vendor and generation as much as on the code (MKL
takes its fast paths on Intel, oneDNN packs weights everywhere), and the
machines this project runs on change, so no figure goes out without its CPU.
Under a hypervisor the model name is often just "AMD EPYC", which has meant
both a Zen 3 with AVX2 and a Zen 4 with AVX-512 here, so the name comes with
the CPU family and model numbers and the widest vector instructions it has.
"""
from __future__ import annotations

import platform
from pathlib import Path

# /proc/cpuinfo flag -> its name in the description, widest first.
VECTOR_FLAGS = {"avx512f": "AVX-512", "avx2": "AVX2", "amx_tile": "AMX"}


def describe_cpuinfo(text: str) -> str | None:
    """/proc/cpuinfo's text -> "AMD EPYC (family 25, model 1; AVX2)", or None when it names no model."""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:  # the first CPU's fields; the others repeat them
            fields[key.strip()] = value.strip()
    if "model name" not in fields:
        return None
    flags = set(fields.get("flags", "").split())
    vector = [name for flag, name in VECTOR_FLAGS.items() if flag in flags]
    if "AVX-512" in vector and "AVX2" in vector:
        vector.remove("AVX2")  # implied by AVX-512
    numbers = [f"{label} {fields[key]}" for key, label in (("cpu family", "family"), ("model", "model"))
               if key in fields]
    details = ", ".join(numbers) + ("; " + ", ".join(vector) if vector else "")
    return f"{fields['model name']} ({details})" if details else fields["model name"]


def cpu_model() -> str:
    """The CPU's model name with its family, model and vector extensions
    ("AMD EPYC (family 25, model 1; AVX2)"), from /proc/cpuinfo where there is one."""
    try:
        described = describe_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        described = None
    return described or platform.processor() or platform.machine()


def device_name(device) -> str:
    """What a figure ran on, in words: "cpu (Intel(R) Xeon(R) ...)" or the GPU's name."""
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({cpu_model()})"
