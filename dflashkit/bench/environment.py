"""Where and with what a benchmark ran: the machine, library versions and the dflashkit commit."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import platform
import subprocess
from typing import Any

import torch

from dflashkit.kernels import row_kernels

PACKAGES = ("dflashkit", "torch", "transformers", "tokenizers", "llama-cpp-python", "matplotlib", "numpy")


def cpu_model() -> str:
    """The CPU's model name with its family and model numbers (from /proc/cpuinfo on Linux: virtual machines often
    report a bare "AMD EPYC", and two generations of it decode at very different speeds), else what platform
    reports."""
    try:
        return cpu_model_from(pathlib.Path("/proc/cpuinfo").read_text())
    except (OSError, ValueError):
        return platform.processor() or platform.machine()


def cpu_model_from(cpuinfo: str) -> str:
    """ "NAME (family F, model M)" from the first processor of a /proc/cpuinfo text."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor only
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "model name" not in fields:
        raise ValueError("no model name in cpuinfo")
    numbers = [f"{k} {fields[k2]}" for k, k2 in (("family", "cpu family"), ("model", "model")) if k2 in fields]
    return fields["model name"] + (f" ({', '.join(numbers)})" if numbers else "")


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the vector ISA torch's kernels use
        "cpu_kernels": row_kernels.label() or "oneDNN",  # what dflashkit's decoding steps run on (row_kernels)
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages * size / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def commit() -> dict[str, Any] | None:
    """The git commit of the dflashkit source tree, and whether it has uncommitted changes (None outside git)."""
    root = pathlib.Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"sha": sha, "dirty": dirty}
