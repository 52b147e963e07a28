"""One line describing the machine a benchmark ran on, for its result table."""

import os
import platform
from pathlib import Path


def machine(gpu: str | None = None) -> str:
    """The CPU, its cores, Python, and ``gpu`` (the GPU the benchmark ran on) if any."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {gpu or 'no GPU'}"
