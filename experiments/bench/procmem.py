"""Resident-memory probes from /proc for the CPU benchmarks (Linux only)."""


def proc_kb(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (e.g. ``VmHWM``, ``VmRSS``); -1 if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def reset_hwm() -> bool:
    """Reset the resident-set high-water mark (``VmHWM``); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_maps() -> int:
    """This process's memory mappings (lines of ``/proc/self/maps``; Linux allows ``vm.max_map_count``)."""
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)
