"""What a figure was measured on: the CPU's model, printed beside every benchmark's numbers.

Speeds on a CPU depend on its vendor and generation as much as on the code (MKL
takes its fast paths on Intel, oneDNN packs weights everywhere), and the
machines this project runs on change, so no figure goes out without its CPU.
"""
from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 7763 64-Core Processor"), from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device) -> str:
    """What a figure ran on, in words: "cpu (Intel(R) Xeon(R) ...)" or the GPU's name."""
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({cpu_model()})"
