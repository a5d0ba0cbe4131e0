"""Helpers shared by the benchmark programs: memory high-water marks, the page
cache, fsync, file-system facts and summary statistics. No torch import here,
so ``run.py`` stays light.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics

MIB = 1024 * 1024
GIB = 1024 * MIB


# --- memory -----------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_kib() -> int:
    """Current resident set size of this process (KiB)."""
    return _status_kib("VmRSS")


def hwm_kib() -> int:
    """Peak resident set size since the last ``reset_hwm`` (KiB)."""
    return _status_kib("VmHWM")


def reset_hwm() -> bool:
    """Reset this process's peak RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``).

    Returns False where that is not permitted; the peak is then the process's
    lifetime peak and the "added" figures are lower bounds of nothing useful.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# --- page cache and durability ------------------------------------------------------


def drop_page_cache() -> tuple[bool, str]:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``. Returns (done, why not)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True, ""
    except OSError as e:
        return False, f"{type(e).__name__}: {e.strerror or e}"


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file and directory under ``root`` (then ``root`` itself)."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


# --- machine facts --------------------------------------------------------------------


def filesystem_of(path: str) -> dict:
    """Mount point, type, device and options of the file system holding ``path``."""
    real = os.path.realpath(path)
    best = {"mountpoint": "?", "type": "?", "device": "?", "options": ""}
    best_len = -1
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, opts, *_ = line.split()
                mnt = mnt.replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) > best_len:
                    best = {"mountpoint": mnt, "type": fstype, "device": dev, "options": opts}
                    best_len = len(mnt)
    except OSError:
        pass
    return best


def machine_info(path: str) -> dict:
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    fs = filesystem_of(path)
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(mem / GIB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "filesystem": fs["type"],
        "filesystem_device": fs["device"],
        "load_average_at_start": list(os.getloadavg()),
    }


# --- statistics ---------------------------------------------------------------------------


def summarize(samples: list[float]) -> dict:
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
    }


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1.0:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"
