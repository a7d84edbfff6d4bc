"""Per-call peak memory and device totals: CUDA allocator stats on GPU, the process's RSS
high-water mark on CPU."""

from __future__ import annotations

import gc
import os
import resource

import torch


def reset_peak(device: torch.device) -> None:
    """Start a per-call peak: CUDA peak stats, or the process's RSS high-water mark on Linux."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass  # not Linux / not allowed: the peak is then the process lifetime's


def read_peak(device: torch.device) -> tuple[int, int]:
    """(peak allocated, peak reserved) bytes since ``reset_peak``; on CPU both are peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    rss = peak_rss_bytes()
    return rss, rss


def peak_rss_bytes() -> int:
    """The process's peak resident set size in bytes (VmHWM, else ``ru_maxrss``)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def device_total_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` (host RAM on CPU), or None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def free_device_memory(device: torch.device) -> None:
    """After an out-of-memory error (called outside its ``except``): collect what only a
    reference cycle still holds, then return cached CUDA blocks to the driver."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
