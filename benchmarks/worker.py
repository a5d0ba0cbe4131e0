"""One benchmark job: every scenario at one world size, interleaved per repeat.

Started by ``run.py`` (never by hand) as
``torchrun --standalone --nproc-per-node=N benchmarks/worker.py --config C --result R``
or, for the MPI commit scenario, ``mpiexec -n N python benchmarks/worker.py --launcher mpi ...``.

Every measurement is framed by barriers on a group of its own (``timed``):
barrier, [drop the page cache], reset the peak RSS, barrier, start the clock,
run the operation on every rank, barrier, stop the clock. Rank 0 gathers each
rank's local times and peak RSS and writes the records to ``--result`` after
every scenario (so a failing job still leaves what it measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor

warnings.filterwarnings("ignore")  # DCP and torch.load emit deprecation/experimental warnings on every call

import _common as C  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

import tddist  # noqa: E402

THREADS = 2  # writer threads for every implementation that has a knob (tddist, DCP, tensordict, raw)
BLOCK = 32 * C.MIB  # raw pwrite/pread block size: tddist's checksum block
STEP = 8 * C.MIB  # bytes per pwrite call: tddist's write step


# --- communication and timing ------------------------------------------------------------


class Ctx:
    """Rank, world, and the benchmark's own barrier/gather (never on a group the libraries use)."""

    def __init__(self, launcher: str):
        self.launcher = launcher
        if launcher == "torchrun":
            import torch.distributed as dist

            self.dist = dist
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3600))
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self.timing_pg = dist.new_group(backend="gloo")
            # DCP's documentation advises a separate process group for async_save, so its
            # background collectives never interleave with the caller's.
            self.async_pg = dist.new_group(backend="gloo")
            self.mesh = None
            if self.world > 1:
                from torch.distributed.device_mesh import init_device_mesh

                self.mesh = init_device_mesh("cpu", (self.world,))
        else:
            from mpi4py import MPI

            self.MPI = MPI
            self.mpi = MPI.COMM_WORLD.Dup()
            self.rank, self.world = self.mpi.Get_rank(), self.mpi.Get_size()

    def barrier(self) -> None:
        if self.launcher == "torchrun":
            self.dist.barrier(group=self.timing_pg)
        else:  # a polite barrier: MPICH's blocking Barrier spins, which steals the 2 cores from working ranks
            req = self.mpi.Ibarrier()
            while not req.Test():
                time.sleep(20e-6)

    def gather(self, obj) -> list | None:
        if self.launcher == "torchrun":
            out = [None] * self.world if self.rank == 0 else None
            self.dist.gather_object(obj, out, dst=0, group=self.timing_pg)
            return out
        return self.mpi.gather(obj, root=0)

    def bcast(self, obj):
        if self.launcher == "torchrun":
            box = [obj]
            self.dist.broadcast_object_list(box, src=0, group=self.timing_pg)
            return box[0]
        return self.mpi.bcast(obj, root=0)

    def close(self) -> None:
        if self.launcher == "torchrun":
            self.dist.destroy_process_group()


class Recorder:
    def __init__(self, ctx: Ctx, cfg: dict, result_path: str):
        self.ctx, self.cfg, self.path = ctx, cfg, result_path
        self.records: list[dict] = []
        self.notes: list[str] = []
        self.cache_warned = False
        self.hwm_ok = C.reset_hwm()
        if not self.hwm_ok:
            self.note("peak RSS cannot be reset (/proc/self/clear_refs not writable): RSS figures are lifetime peaks")

    def note(self, text: str) -> None:
        if self.ctx.rank == 0 and text not in self.notes:
            self.notes.append(text)
            log(f"NOTE: {text}")

    def flush(self) -> None:
        if self.ctx.rank != 0:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"records": self.records, "notes": self.notes}, f)
        os.replace(tmp, self.path)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure(
    rec: Recorder,
    scenario: str,
    impl: str,
    ref: str,
    fn,
    *,
    repeat: int,
    nbytes: int | None = None,
    cold: bool = False,
    sample: int | None = None,
    quiet: bool = False,
    extra: dict | None = None,
    cpu: bool = False,
) -> float:
    """Time ``fn()`` on every rank between barriers; record it (rank 0). Returns the wall time.

    ``fn`` may return a dict of named local phase times (``{"open": s}``);
    each becomes a metric (the maximum over ranks). ``time`` is the wall time
    from the start barrier to the end barrier. With ``cpu``, each rank also
    measures the CPU time its process (every thread of it) spent in ``fn()``
    (``time.process_time``, barriers excluded): metric ``cpu`` is the sum over
    ranks, ``cpu_ranks`` each rank's. Where ranks share the cores, that sum
    divided by the number of cores is the least wall time any overlap of the
    work can take.
    """
    ctx = rec.ctx
    ctx.barrier()
    dropped = None
    if cold:
        if ctx.rank == 0:
            dropped, why = C.drop_page_cache()
            if not dropped and not rec.cache_warned:
                rec.note(f"could not drop the page cache ({why}); 'cold' reads may be served from memory")
                rec.cache_warned = True
    elif ctx.rank == 0:
        os.sync()  # earlier writeback must not land in this measurement
    ctx.barrier()
    base = C.rss_kib()
    C.reset_hwm()
    ctx.barrier()
    c0 = time.process_time()
    t0 = time.perf_counter()
    phases = fn()
    local = time.perf_counter() - t0
    used = time.process_time() - c0
    if not isinstance(phases, dict):  # a save's own return value (DCP's Metadata, ...) is not a phase
        phases = {}
    ctx.barrier()
    wall = time.perf_counter() - t0
    peak = C.hwm_kib()
    mine = {"local": local, "phases": phases, "added": (peak - base) / 1024, "peak": peak / 1024}
    got = ctx.gather(dict(mine, cpu=used) if cpu else mine)
    if ctx.rank == 0:
        metrics = {"time": wall}
        for name in phases:
            metrics[name] = max(g["phases"][name] for g in got)
        if cpu:
            metrics["cpu"] = sum(g["cpu"] for g in got)
        r = {
            "scenario": scenario,
            "world": ctx.world,
            "launcher": ctx.launcher,
            "impl": impl,
            "ref": ref,
            "repeat": repeat,
            "metrics": metrics,
            "rank_seconds": [g["local"] for g in got],
            "bytes": nbytes,
            "rss_added_mib": max(g["added"] for g in got),
            "rss_added_mib_ranks": [round(g["added"], 1) for g in got],
            "rss_peak_mib_ranks": [round(g["peak"], 1) for g in got],
            "cold": dropped if cold else None,
        }
        if cpu:
            r["cpu_ranks"] = [g["cpu"] for g in got]
        if sample is not None:
            r["sample"] = sample
        if extra:
            r["extra"] = extra
        rec.records.append(r)
        if not quiet:
            shown = ", ".join(f"{k} {C.fmt_seconds(v)}" for k, v in metrics.items())
            log(f"[{ctx.launcher} N={ctx.world} rep {repeat}] {scenario:<14} {impl:<26} {shown}")
    return wall


# --- data -------------------------------------------------------------------------------------


def make_rows(leaf: int, start: int, stop: int, cols: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of leaf ``leaf`` of the global payload (any range, deterministic)."""
    g = torch.Generator().manual_seed(1000 + leaf)
    pattern = torch.rand(97, cols, generator=g)
    idx = torch.arange(start, stop)
    out = pattern[idx % 97]
    out += idx.unsqueeze(1).to(torch.float32)
    return out


def even_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    return n * rank // world, n * (rank + 1) // world


class Payload:
    """This rank's shard of the global payload, as a TensorDict (tddist, tensordict), a state dict
    of DTensors (DCP; plain tensors on one rank) and a dict of local tensors (torch.save, raw)."""

    def __init__(self, ctx: Ctx, rows: int, leaves: int, cols: int, *, rank=None, world=None):
        self.ctx = ctx
        self.rank = ctx.rank if rank is None else rank
        self.world = ctx.world if world is None else world
        self.rows, self.leaves, self.cols = rows, leaves, cols
        self.start, self.stop = even_rows(rows, self.rank, self.world)
        self.tensors = {f"w{i}": make_rows(i, self.start, self.stop, cols) for i in range(leaves)}
        self.td = TensorDict(self.tensors, batch_size=[self.stop - self.start])
        self.sd = dcp_state(ctx, self.tensors, self.world)
        self.nbytes = sum(t.nbytes for t in self.tensors.values())

    def empty_sd(self, world: int):
        """A pre-sized DCP state dict of this rank's shard on ``world`` ranks (memory already touched)."""
        a, b = even_rows(self.rows, self.ctx.rank, world)
        return dcp_state(self.ctx, {k: torch.empty(b - a, self.cols).fill_(0) for k in self.tensors}, world)

    def check(self, tensors: dict, world: int) -> None:
        """The loaded shard holds the expected rows (first and last row of each leaf)."""
        a, b = even_rows(self.rows, self.ctx.rank, world)
        for i in range(self.leaves):
            t = local_of(tensors[f"w{i}"])
            assert t.shape == (b - a, self.cols), (t.shape, b - a)
            if b > a:
                for r in (a, b - 1):
                    if not torch.equal(t[r - a], make_rows(i, r, r + 1, self.cols)[0]):
                        raise AssertionError(f"rank {self.ctx.rank}: leaf w{i} row {r} has wrong values")


def dcp_state(ctx: Ctx, tensors: dict, world: int) -> dict:
    if world == 1:
        return dict(tensors)
    from torch.distributed.tensor import DTensor, Shard

    return {k: DTensor.from_local(t, ctx.mesh, [Shard(0)], run_check=False) for k, t in tensors.items()}


def local_of(t):
    return t.to_local() if hasattr(t, "to_local") else t


def leaves_of(obj) -> list[torch.Tensor]:
    if isinstance(obj, TensorDict):
        return [local_of(t) for t in obj.values(include_nested=True, leaves_only=True)]
    if isinstance(obj, dict):
        out = []
        for v in obj.values():
            out.extend(leaves_of(v) if isinstance(v, dict) else [local_of(v)])
        return out
    return [local_of(obj)]


def touch(obj) -> int:
    """Read every byte of every tensor (a sum over 8-byte words)."""
    acc = 0
    for t in leaves_of(obj):
        if not t.numel():
            continue
        flat = t.reshape(-1)
        if t.nbytes % 8 == 0:
            acc += int(flat.view(torch.uint8).view(torch.int64).sum())
        else:
            acc += int(flat.view(torch.uint8).sum())
    return acc


# --- the implementations -------------------------------------------------------------------


def dcp():
    import torch.distributed.checkpoint as m

    return m


def dcp_cached_staging(m, init_path: str):
    """DCP's staging with buffers reused from one ``async_save`` to the next: ``(writer, stager)``.

    Where an accelerator is available: ``FileSystemWriter(cache_staged_state_dict=True)``, DCP's
    documented option (the writer stages, into pinned buffers it keeps; one writer for every save,
    each given its ``checkpoint_id``). Without one that option fails (it pins memory), and torch
    2.13's ``DefaultStager`` with pinning, sharing, background staging and non-blocking copies
    turned off does the same on the CPU: it keeps one staging storage per source storage and
    copies into it on every save. Returns ``(writer, None)`` or ``(None, stager)``.
    """
    if torch.cuda.is_available():
        writer = m.FileSystemWriter(init_path, thread_count=THREADS, sync_files=True, cache_staged_state_dict=True)
        return writer, None
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(
        use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
    )
    return None, DefaultStager(options)


def tddist_modes(archive: bool) -> list[tuple[str, dict]]:
    """The tddist layouts to benchmark: ``(label, extra save options)``.

    ARCHIVE HOOK: the directory layout is the one tddist ships. The archive
    layout (one ``.tdz`` file, ``archive=True``) joins the durable-save and
    load scenarios as ``tddist[archive]`` when run.py gets ``--archive`` and a
    save + load round trip in archive mode works on this tddist; it is saved
    with ``archive=True`` to ``<path>.tdz`` and read back with ``tddist.load``.
    Add archive-specific options (``compression=``) to its dict here.
    """
    modes = [("tddist", {})]
    if archive:
        ok, why = _archive_supported()
        if ok:
            modes.append(("tddist[archive]", {"archive": True}))
        else:
            modes.append(("unsupported", {"why": why}))
    return modes


def _archive_supported() -> tuple[bool, str]:
    """Whether this tddist saves and loads archives (a one-process round trip)."""
    with tempfile.TemporaryDirectory(prefix="tddist-archive-probe-") as d:
        path = os.path.join(d, "probe" + ARCHIVE_SUFFIX)
        try:
            x = torch.arange(6.0).view(3, 2)
            tddist.save(TensorDict(x=x, batch_size=[3]), path, comm=tddist.LocalComm(), archive=True)
            back = tddist.load(path, comm=tddist.LocalComm())
            if not torch.equal(back["x"], x):
                return False, "an archive round trip returned other values"
            return True, ""
        except Exception as e:  # any failure: the layout is not usable yet
            return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


ARCHIVE_SUFFIX = ".tdz"


def tddist_path(path: str, opts: dict) -> str:
    return path + ARCHIVE_SUFFIX if opts.get("archive") else path


def rank_dir(path: str, rank: int) -> str:
    return os.path.join(path, f"rank-{rank:05d}")


def save_tddist(path: str, p: Payload, opts: dict) -> None:
    out = tddist.save(p.td, tddist_path(path, opts), num_threads=THREADS, **opts)
    del out


def save_dcp(path: str, p: Payload) -> None:
    m = dcp()
    m.save(p.sd, storage_writer=m.FileSystemWriter(path, thread_count=THREADS, sync_files=True))


def save_torch(path: str, tensors: dict, rank: int) -> None:
    os.makedirs(path, exist_ok=True)
    f_path = os.path.join(path, f"rank-{rank:05d}.pt")
    with open(f_path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())
    C.fsync_path(path)


def save_tensordict(path: str, p: Payload, rank: int) -> None:
    d = rank_dir(path, rank)
    os.makedirs(path, exist_ok=True)
    out = p.td.memmap(prefix=d, num_threads=THREADS)
    del out
    C.fsync_tree(d)
    C.fsync_path(path)


RAW_ALIGN = 64  # the raw file's leaves start on 64-byte boundaries, as in tddist's packed data file


def raw_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank-{rank:05d}.bin")


def raw_layout(tensors: dict) -> list[tuple[memoryview, int]]:
    """Each tensor's bytes and its offset in the rank's raw file: back to back, 64-byte aligned."""
    out, end = [], 0
    for t in tensors.values():
        mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        out.append((mv, end))
        end += -(-len(mv) // RAW_ALIGN) * RAW_ALIGN
    return out


class _RawFile:
    """One file of the raw write: its descriptor and how many of its blocks are still to land."""

    def __init__(self, path: str, size: int, nblocks: int):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        if size:
            os.posix_fallocate(self.fd, 0, size)
        self.remaining = nblocks
        self.lock = threading.Lock()

    def block_done(self) -> None:
        """Called once per block; the thread that writes the last block fsyncs the file."""
        with self.lock:
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            os.fsync(self.fd)


def save_raw(path: str, tensors: dict, rank: int) -> None:
    """The raw limit: the fastest durable write of this rank's bytes we can write by hand.

    Hand-written, not a library's writer, because it is the floor a library is
    judged against: the same bytes into the same files as tddist's default
    layout (one preallocated data file per rank, the leaves back to back), with
    none of a checkpoint's work (no checksum, manifest, commit or rename) and
    every trick for speed that costs nothing in durability:

    - 32 MiB blocks (tddist's checksum block) written by ``THREADS`` threads
      with positioned ``os.pwrite`` calls of 8 MiB (tddist's write step);
    - each block's writeback started as soon as it is written
      (``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the disk works while
      the next blocks are copied instead of waiting for the final fsync
      (tddist leaves all writeback to its fsync);
    - each file fsynced by the thread that writes its last block, overlapping
      the writes still in flight, as tddist's writer does;
    - then the directory entries: the file's in ``path``, ``path``'s in its parent.
    """
    os.makedirs(path, exist_ok=True)
    layout = raw_layout(tensors)
    size = max((off + len(mv) for mv, off in layout), default=0)
    blocks = [(mv[lo : lo + BLOCK], off + lo) for mv, off in layout for lo in range(0, len(mv), BLOCK)]
    f = _RawFile(raw_file(path, rank), size, len(blocks))
    try:

        def write(block):
            data, at = block
            pos = 0
            while pos < len(data):
                pos += os.pwrite(f.fd, data[pos : pos + STEP], at + pos)
            C.start_writeback(f.fd, at, len(data))
            f.block_done()

        with ThreadPoolExecutor(THREADS) as ex:
            list(ex.map(write, blocks))
        if not blocks:
            os.fsync(f.fd)
    finally:
        os.close(f.fd)
    C.fsync_path(path)
    C.fsync_path(os.path.dirname(os.path.abspath(path)))


def _dd_shape(nbytes: int) -> tuple[int, int]:
    bs = 16 * C.MIB if nbytes >= 16 * C.MIB else C.MIB
    return bs, max(1, math.ceil(nbytes / bs))


def dd_bytes(nbytes: int) -> int:
    bs, count = _dd_shape(nbytes)
    return bs * count


def dd_source(path: str, nbytes: int, rank: int) -> str:
    """This rank's dd source: ``dd_bytes(nbytes)`` pseudo-random bytes, written and fsynced untimed."""
    src = os.path.join(path, f"rank-{rank:05d}.random")
    if not os.path.exists(src) or os.path.getsize(src) != dd_bytes(nbytes):
        os.makedirs(path, exist_ok=True)
        C.write_random_file(src, dd_bytes(nbytes), seed=rank)
    return src


def save_dd(path: str, src: str, nbytes: int, rank: int) -> int:
    """``dd if=SRC bs=16M conv=fsync`` of this rank's share: one sequential buffered write of
    incompressible bytes read from a page-cache-warm file, fsynced once at the end. Returns bytes written."""
    os.makedirs(path, exist_ok=True)
    bs, count = _dd_shape(nbytes)
    subprocess.run(
        [
            "dd",
            f"if={src}",
            f"of={os.path.join(path, f'rank-{rank:05d}.dd')}",
            f"bs={bs}",
            f"count={count}",
            "conv=fsync",
            "status=none",
        ],
        check=True,
    )
    return bs * count


def load_tddist(path: str, **kw) -> dict:
    t0 = time.perf_counter()
    td = tddist.load(path, num_threads=THREADS, **kw)
    opened = time.perf_counter() - t0
    touch(td)
    return {"open": opened}, td


def load_dcp(path: str, sd: dict) -> dict:
    m = dcp()
    t0 = time.perf_counter()
    m.load(sd, storage_reader=m.FileSystemReader(path))
    opened = time.perf_counter() - t0
    touch(sd)
    return {"open": opened}, sd


def load_torch(path: str, rank: int, mmap: bool) -> dict:
    t0 = time.perf_counter()
    obj = torch.load(os.path.join(path, f"rank-{rank:05d}.pt"), mmap=mmap, weights_only=True)
    opened = time.perf_counter() - t0
    touch(obj)
    return {"open": opened}, obj


def load_tensordict(path: str, rank: int) -> dict:
    t0 = time.perf_counter()
    td = TensorDict.load_memmap(rank_dir(path, rank))
    opened = time.perf_counter() - t0
    touch(td)
    return {"open": opened}, td


def load_raw(path: str, buffers: dict, rank: int) -> dict:
    """Threaded positioned reads of the rank's raw file (``save_raw``) into pre-sized, already touched buffers."""
    t0 = time.perf_counter()
    fd = os.open(raw_file(path, rank), os.O_RDONLY)
    try:
        blocks = [(mv[lo : lo + BLOCK], off + lo) for mv, off in raw_layout(buffers) for lo in range(0, len(mv), BLOCK)]

        def read(block):
            blk, at = block
            pos = 0
            while pos < len(blk):
                n = os.preadv(fd, [blk[pos : pos + STEP]], at + pos)
                if n <= 0:
                    raise OSError(f"short read in {raw_file(path, rank)}")
                pos += n

        with ThreadPoolExecutor(THREADS) as ex:
            list(ex.map(read, blocks))
    finally:
        os.close(fd)
    return {"open": time.perf_counter() - t0}, buffers


_RANK_NAME = re.compile(r"(?:^|/)rank-(\d+)(?:[./]|$)|(?:^|/)__(\d+)_\d+\.distcp$")


def count_files(path: str) -> dict:
    """The files a checkpoint holds: per rank (by the rank in their name: tddist's ``rank-NNNNN.data`` or
    ``rank-NNNNN/``, DCP's ``__R_T.distcp``, torch.save's ``rank-NNNNN.pt``) and shared (the rest: manifests)."""
    per_rank: dict[int, int] = {}
    shared: list[str] = []
    if os.path.isfile(path):
        return {"total": 1, "per_rank_max": 0, "per_rank": {}, "shared": [os.path.basename(path)]}
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), path).replace(os.sep, "/")
            m = _RANK_NAME.search(rel)
            if m:
                rank = int(m.group(1) or m.group(2))
                per_rank[rank] = per_rank.get(rank, 0) + 1
            else:
                shared.append(rel)
    return {
        "total": sum(per_rank.values()) + len(shared),
        "per_rank_max": max(per_rank.values(), default=0),
        "per_rank": {str(k): v for k, v in sorted(per_rank.items())},
        "shared": sorted(shared),
    }


def tddist_packing(path: str) -> str | None:
    """The packing a tddist directory checkpoint was written with ("packed" or "memmap"), from its manifest."""
    try:
        with open(os.path.join(path, "tddist.json"), "rb") as f:
            return json.loads(f.read()).get("packing", "memmap (format v1)")
    except (OSError, ValueError):
        return None


def discard(_value) -> None:
    """Drop what a save returns (tddist maps the saved shard back)."""
    return None


# --- scenarios ---------------------------------------------------------------------------------


class Job:
    def __init__(self, ctx: Ctx, cfg: dict, rec: Recorder):
        self.ctx, self.cfg, self.rec = ctx, cfg, rec
        self.rank, self.world = ctx.rank, ctx.world
        self.work = os.path.join(cfg["dir"], f"{ctx.launcher}-w{ctx.world}")
        self.keep = os.path.join(cfg["dir"], f"keep-w{ctx.world}")  # last durable saves, read by loads/reshard
        self.repeats = cfg["repeats"]
        self._payload = None
        self.modes = [("tddist", {})]
        if ctx.launcher == "torchrun":
            modes = tddist_modes(cfg.get("archive", False))
            for label, opts in modes:
                if label == "unsupported":
                    rec.note(f"--archive: tddist cannot save and load archives here ({opts['why']}); not measured")
            self.modes = [(label, opts) for label, opts in modes if label != "unsupported"]

    # helpers
    def path(self, *parts) -> str:
        return os.path.join(self.work, *parts)

    def clean(self, *paths) -> None:
        self.ctx.barrier()
        if self.rank == 0:
            for p in paths:
                C.remove(p)
        self.ctx.barrier()

    def mkdirs(self, *paths) -> None:
        if self.rank == 0:
            for p in paths:
                os.makedirs(p, exist_ok=True)
        self.ctx.barrier()

    @property
    def payload(self) -> Payload:
        if self._payload is None:
            self._payload = Payload(self.ctx, self.cfg["rows"], self.cfg["leaves"], self.cfg["cols"])
        return self._payload

    def total_bytes(self) -> int:
        return self.cfg["rows"] * self.cfg["leaves"] * self.cfg["cols"] * 4

    def warmup(self) -> None:
        """Create tddist's private gloo group and DCP's first-call state outside any timing."""
        tiny = TensorDict(x=torch.zeros(2, 4), batch_size=[2])
        tddist.save(tiny, self.path("warm", "tddist"))
        if self.ctx.launcher == "torchrun":
            m = dcp()
            m.save(
                dcp_state(self.ctx, {"x": torch.zeros(2, 4)}, self.world),
                storage_writer=m.FileSystemWriter(self.path("warm", "dcp"), sync_files=True),
            )
        self.clean(self.path("warm"))

    # 1. durable save, directory mode
    def save_impls(self, p: Payload):
        r = self.rank
        impls = [(label, (lambda path, o=opts: save_tddist(path, p, o))) for label, opts in self.modes]
        impls += [
            ("dcp", lambda path: save_dcp(path, p)),
            ("torch.save+fsync", lambda path: save_torch(path, p.tensors, r)),
            ("td.memmap+fsync", lambda path: save_tensordict(path, p, r)),
            ("raw pwrite+fsync", lambda path: save_raw(path, p.tensors, r)),
        ]
        return impls

    def scenario_save(self) -> None:
        p = self.payload
        total = self.total_bytes()
        impls = [(label, fn, total, True) for label, fn in self.save_impls(p)]
        # dd copies from a file of random bytes, written and fsynced here (untimed) and read back
        # into the page cache before each of its runs, so it writes data as incompressible as a
        # checkpoint's and its reads cost no disk time.
        src = dd_source(self.path("dd-source"), p.nbytes, self.rank)
        C.cycle_page_cache(os.path.join(self.path("dd-source"), f"rank-{self.rank:05d}.cycle"), p.nbytes)
        impls.append(
            (
                "dd conv=fsync",
                lambda out: discard(save_dd(out, src, p.nbytes, self.rank)),
                self.world * dd_bytes(p.nbytes),
                False,
            )
        )
        self.mkdirs(self.keep)
        for rep in range(self.repeats):
            for label, fn, nbytes, keep in rotated(impls, rep):
                out = self.path("save", label.replace(" ", "_"))
                produced = out + self.suffix(label)
                self.clean(out, produced)
                if label == "dd conv=fsync":
                    C.warm_file(src)
                measure(self.rec, "save", label, "tddist", lambda: fn(out), repeat=rep, nbytes=nbytes)
                if self.rank == 0 and label == "tddist":  # the default layout, whatever this tddist's default is
                    packing = tddist_packing(produced)
                    self.rec.records[-1]["extra"] = {"packing": packing}
                    if packing != "packed":
                        self.rec.note(f"save: tddist's default layout wrote packing {packing!r}, not 'packed'")
                if keep and rep == self.repeats - 1:
                    self.ctx.barrier()
                    if self.rank == 0:
                        kept = self.keep_path(label) + self.suffix(label)
                        C.remove(kept)
                        os.replace(produced, kept)
                    self.ctx.barrier()
                else:
                    self.clean(out, produced)
        self.clean(self.path("dd-source"))

    def keep_path(self, label: str) -> str:
        return os.path.join(self.keep, label.replace(" ", "_"))

    def suffix(self, label: str) -> str:
        """The file name suffix a save with this label adds to its path (archives are one .tdz file)."""
        return next((tddist_path("", opts) for lab, opts in self.modes if lab == label), "")

    def ensure_kept(self, labels) -> None:
        """Load scenarios read the last durable saves; write them (untimed) if save did not run."""
        self.mkdirs(self.keep)
        impls = self.save_impls(self.payload)
        missing = {
            lab for lab, _ in impls if lab in labels and not os.path.exists(self.keep_path(lab) + self.suffix(lab))
        }
        self.ctx.barrier()  # every rank looked before a save creates its directory (a later look would skip it)
        for label, fn in impls:
            if label in missing:
                fn(self.keep_path(label))
                self.ctx.barrier()

    # 2. return_early / async_save
    def scenario_async(self) -> None:
        if self.ctx.launcher != "torchrun":
            return
        from tddist.comm.resolve import resolve
        from tddist.saving import background

        m = dcp()
        p = self.payload
        total = self.total_bytes()
        cached_writer, cached_stager = dcp_cached_staging(m, self.path("async", "dcp-cached-init"))
        if cached_writer is None:
            self.rec.note(
                "dcp.async_save(cached): FileSystemWriter(cache_staged_state_dict=True) pins its staging "
                "buffers, which needs an accelerator in this torch; measured instead with DCP's own "
                "DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, "
                "use_async_staging=False, use_non_blocking_copy=False)) kept across saves, which also "
                "copies into the buffers of the first save"
            )
        channel = None
        state = {}

        def tddist_async(out):
            t0 = time.perf_counter()
            fut = tddist.save(p.td, out, return_early=True, num_threads=THREADS)
            blocking = time.perf_counter() - t0
            fut.result()
            return {"blocking": blocking}

        def tddist_sync(out):
            t0 = time.perf_counter()
            tddist.save(p.td, out, num_threads=THREADS)
            return {"blocking": time.perf_counter() - t0}

        def dcp_async(out, cached=False):
            t0 = time.perf_counter()
            if not cached:
                writer = m.FileSystemWriter(out, thread_count=THREADS, sync_files=True)
                fut = m.async_save(p.sd, storage_writer=writer, process_group=self.ctx.async_pg)
            elif cached_writer is not None:  # the writer is the stager: one writer for every save
                fut = m.async_save(
                    p.sd, checkpoint_id=out, storage_writer=cached_writer, process_group=self.ctx.async_pg
                )
            else:
                writer = m.FileSystemWriter(out, thread_count=THREADS, sync_files=True)
                fut = m.async_save(
                    p.sd, storage_writer=writer, async_stager=cached_stager, process_group=self.ctx.async_pg
                )
            blocking = time.perf_counter() - t0
            fut.result()
            return {"blocking": blocking}

        kept = {}

        def plain_copy(out):
            """What blocking cannot go below without deferring the copy: one ``copy_`` of the state into
            buffers kept across saves (allocated by the first), on the caller's thread; nothing written."""
            if "buffers" not in kept:
                kept["buffers"] = p.td.clone()
            t0 = time.perf_counter()
            kept["buffers"].copy_(p.td)
            return {"blocking": time.perf_counter() - t0}

        impls = [
            ("tddist return_early", tddist_async),
            ("tddist (synchronous)", tddist_sync),
            ("plain copy_", plain_copy),
            ("dcp.async_save", dcp_async),
            ("dcp.async_save(cached)", lambda out: dcp_async(out, cached=True)),
        ]
        # Each checkpoint is removed only after the next save of the same implementation, as a
        # rotation would: tddist keeps the future of its last asynchronous save (and the result it
        # maps) until the next save, so removing a checkpoint right after writing it would move
        # freeing its blocks (an ext4 truncate, plus a synchronous discard on a "discard" mount)
        # into the next timed save.
        previous: dict[str, str] = {}

        def run(scenario, label, fn, rep):
            out = self.path("async", label.replace(" ", "_"), f"{scenario.split()[-1]}-{rep}")
            self.clean(out)
            before = channel.buffers.allocations if channel is not None else 0
            measure(self.rec, scenario, label, "tddist return_early", lambda: fn(out), repeat=rep, nbytes=total)
            if label == "tddist return_early" and channel is not None and self.rank == 0:
                self.rec.records[-1]["extra"] = {"new_buffer_allocations": channel.buffers.allocations - before}
            if label in previous:
                self.clean(previous[label])
            previous[label] = out

        # First save of each: allocates snapshot buffers / DCP's staging copy. Recorded apart, not in the stats.
        for label, fn in impls:
            run("async first", label, fn, 0)
            if label == "tddist return_early":
                channel = background.channel(resolve())
                state["after_first"] = channel.buffers.allocations
        for rep in range(self.cfg.get("async_repeats", self.repeats)):
            for label, fn in rotated(impls, rep):
                run("async save", label, fn, rep)
        self.clean(*previous.values())
        if cached_stager is not None:
            cached_stager.close()
        news = self.ctx.gather(channel.buffers.allocations - state["after_first"])
        if self.rank == 0:
            self.rec.records.append(
                {
                    "scenario": "async save",
                    "world": self.world,
                    "launcher": self.ctx.launcher,
                    "kind": "allocations",
                    "buffers_after_first_save": state["after_first"],
                    "new_allocations_after_first_save_per_rank": news,
                }
            )

    # 3. load on the same world size
    def scenario_load(self) -> None:
        p = self.payload
        total = self.total_bytes()
        labels = [label for label, _ in self.modes] + ["dcp", "torch.save+fsync", "td.memmap+fsync", "raw pwrite+fsync"]
        self.ensure_kept(labels)
        r = self.rank
        raw_buffers = {k: torch.empty_like(t).fill_(0) for k, t in p.tensors.items()}
        impls = [
            (label, (lambda lab=label, o=opts: load_tddist(tddist_path(self.keep_path(lab), o))))
            for label, opts in self.modes
        ]
        impls += [
            ("dcp.load", None),
            ("torch.load(mmap=True)", lambda: load_torch(self.keep_path("torch.save+fsync"), r, True)),
            ("torch.load", lambda: load_torch(self.keep_path("torch.save+fsync"), r, False)),
            ("TensorDict.load_memmap", lambda: load_tensordict(self.keep_path("td.memmap+fsync"), r)),
            ("raw pread", lambda: load_raw(self.keep_path("raw pwrite+fsync"), raw_buffers, r)),
        ]
        for rep in range(self.repeats):
            for label, fn in rotated(impls, rep):
                if label == "dcp.load":
                    sd = p.empty_sd(self.world)  # pre-sized and touched outside the timing
                    fn = lambda sd=sd: load_dcp(self.keep_path("dcp"), sd)
                result = {}

                def run(fn=fn):
                    phases, result["value"] = fn()
                    return phases

                measure(self.rec, "load", label, "tddist", run, repeat=rep, nbytes=total, cold=True)
                if rep == 0 and label in ("tddist", "dcp.load"):
                    p.check(leaf_map(result["value"]), self.world)
                result.clear()
        raw_buffers.clear()  # free the buffers before the next scenario
        self.ctx.barrier()
        if self.rank == 0:
            for label in ("torch.save+fsync", "td.memmap+fsync", "raw pwrite+fsync"):
                C.remove(self.keep_path(label))
        self.ctx.barrier()

    # 4. reshard
    def scenario_reshard(self) -> None:
        if self.ctx.launcher != "torchrun":
            return
        p = self.payload
        total = self.total_bytes()
        sources = [(s, paths) for s, paths in self.cfg.get("reshard_from", {}).items()]
        if self.cfg.get("make_world1_source"):
            self.make_world1_source()
            sources.append(("1", self.cfg["world1_source"]))
        if not sources:
            return
        self.ensure_kept(["tddist", "dcp"])
        same = {"tddist": self.keep_path("tddist"), "dcp": self.keep_path("dcp")}
        for src_world, paths in sources:
            if not (os.path.exists(paths["tddist"]) and os.path.exists(paths["dcp"])):
                self.rec.note(f"reshard {src_world}->{self.world}: the source checkpoints are missing; skipped")
                continue
            scen = f"reshard {src_world}->{self.world}"
            impls = [
                (f"tddist {src_world}->{self.world}", lambda: load_tddist(paths["tddist"], shard="even")),
                (f"dcp.load {src_world}->{self.world}", "dcp", paths["dcp"]),
                (f"tddist {self.world}->{self.world} (same layout)", lambda: load_tddist(same["tddist"], shard="even")),
                (f"dcp.load {self.world}->{self.world} (same layout)", "dcp", same["dcp"]),
            ]
            ref = impls[0][0]
            for rep in range(self.repeats):
                for item in rotated(impls, rep):
                    label = item[0]
                    if item[1] == "dcp":
                        sd = p.empty_sd(self.world)
                        fn = lambda sd=sd, path=item[2]: load_dcp(path, sd)
                    else:
                        fn = item[1]
                    result = {}

                    def run(fn=fn):
                        phases, result["value"] = fn()
                        return phases

                    measure(self.rec, scen, label, ref, run, repeat=rep, nbytes=total, cold=True)
                    if rep == 0:
                        p.check(leaf_map(result["value"]), self.world)
                    result.clear()

    def make_world1_source(self) -> None:
        """The checkpoint of the whole payload as one rank saves it (rank 0 alone, untimed)."""
        paths = self.cfg["world1_source"]
        if self.rank == 0 and not (os.path.exists(paths["tddist"]) and os.path.exists(paths["dcp"])):
            whole = Payload(self.ctx, self.cfg["rows"], self.cfg["leaves"], self.cfg["cols"], rank=0, world=1)
            if not os.path.exists(paths["tddist"]):
                tddist.save(whole.td, paths["tddist"], comm=tddist.LocalComm(), num_threads=THREADS)
            if not os.path.exists(paths["dcp"]):
                m = dcp()
                m.save(
                    whole.tensors,
                    storage_writer=m.FileSystemWriter(paths["dcp"], thread_count=THREADS, sync_files=True),
                    no_dist=True,
                )
            del whole
        self.ctx.barrier()

    # 5. metadata-heavy: many small tensors
    def scenario_small(self) -> None:
        """10,000 tiny sharded tensors: tddist in its default layout (packed: one data file per rank) and
        with ``layout="memmap"`` (one file per leaf), DCP, torch.save. Saves, then cold loads + touch; the
        files each checkpoint holds are counted after its first save (untimed)."""
        n, elems = self.cfg["small_tensors"], self.cfg["small_elems"]
        a, b = even_rows(elems, self.rank, self.world)
        tensors = {f"p{i:05d}": torch.arange(a, b, dtype=torch.float32) + i for i in range(n)}
        td = TensorDict(tensors, batch_size=[b - a])
        sd = dcp_state(self.ctx, tensors, self.world) if self.ctx.launcher == "torchrun" else None
        total = n * elems * 4
        m = dcp() if sd is not None else None
        r = self.rank
        # (save label, load label, save function); the default layout is whatever save() does without layout=
        saves = [
            ("tddist", "tddist", lambda out: discard(tddist.save(td, out, num_threads=THREADS))),
            (
                "tddist[memmap]",
                "tddist[memmap]",
                lambda out: discard(tddist.save(td, out, num_threads=THREADS, layout="memmap")),
            ),
        ]
        if sd is not None:
            saves.append(
                (
                    "dcp",
                    "dcp.load",
                    lambda out: m.save(
                        sd, storage_writer=m.FileSystemWriter(out, thread_count=THREADS, sync_files=True)
                    ),
                )
            )
        saves.append(("torch.save+fsync", "torch.load", lambda out: save_torch(out, tensors, r)))
        load_name = {label: name for label, name, _ in saves}

        def empty_sd():
            return dcp_state(self.ctx, {k: torch.empty(b - a).fill_(0) for k in tensors}, self.world)

        for rep in range(self.repeats):
            outs = {}
            for label, _name, fn in rotated(saves, rep):
                out = self.path("small", label.replace(" ", "_").replace("+", "_").replace("[", "_").rstrip("]"))
                outs[label] = out
                self.clean(out)
                extra = {"tensors": n, "bytes": total}
                measure(
                    self.rec,
                    "small save",
                    label,
                    "tddist",
                    lambda fn=fn, out=out: fn(out),
                    repeat=rep,
                    extra=extra,
                )
                if self.rank == 0:
                    extra["files"] = count_files(out)
                    if label.startswith("tddist"):
                        extra["packing"] = tddist_packing(out)
                        if label == "tddist" and extra["packing"] != "packed":
                            self.rec.note(
                                f"small: tddist's default layout wrote packing {extra['packing']!r}, not 'packed'"
                            )
            for label in rotated(list(outs), rep):
                result = {}
                name = load_name[label]
                if label.startswith("tddist"):
                    fn = lambda out=outs[label]: load_tddist(out)
                elif label == "dcp":
                    target = empty_sd()
                    fn = lambda target=target: load_dcp(outs["dcp"], target)
                else:
                    fn = lambda out=outs[label]: load_torch(out, r, False)

                def run(fn=fn):
                    phases, result["value"] = fn()
                    return phases

                measure(
                    self.rec,
                    "small load",
                    name,
                    "tddist",
                    run,
                    repeat=rep,
                    cold=True,
                    extra={"tensors": n, "bytes": total},
                )
                if rep == 0 and name != "torch.load":
                    got = leaf_map(result["value"])
                    for i in (0, n - 1):
                        want = torch.arange(a, b, dtype=torch.float32) + i
                        if not torch.equal(local_of(got[f"p{i:05d}"]), want):
                            raise AssertionError(f"rank {r}: small tensor {i} loaded by {name} has wrong values")
                result.clear()
            self.clean(*outs.values())

    # 6. commit overhead
    def scenario_commit(self) -> None:
        reps = self.cfg["commit_reps"]
        td = TensorDict(x=torch.full((1, 4), float(self.rank)), batch_size=[1])
        torchrun = self.ctx.launcher == "torchrun"
        sd = dcp_state(self.ctx, {"x": td["x"]}, self.world) if torchrun else None
        m = dcp() if torchrun else None
        base = self.path("commit")
        self.mkdirs(base)

        def floor(out):
            """The least a durable multi-rank commit needs: one fsynced file per rank in a staging
            directory, rank 0 fsyncs it, renames it onto the target and fsyncs the parent (3 collectives)."""
            staging = out + ".staging"
            if self.rank == 0:
                os.mkdir(staging)
            self.ctx.barrier()
            fd = os.open(os.path.join(staging, f"rank-{self.rank:05d}.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, td["x"].numpy().tobytes())
            os.fsync(fd)
            os.close(fd)
            self.ctx.barrier()
            if self.rank == 0:
                C.fsync_path(staging)
                os.rename(staging, out)
                C.fsync_path(os.path.dirname(out))
            self.ctx.barrier()

        impls = [("barrier only", lambda out: None), ("tddist", lambda out: discard(tddist.save(td, out)))]
        if torchrun:
            impls.append(("dcp", lambda out: m.save(sd, storage_writer=m.FileSystemWriter(out, sync_files=True))))
        impls.append(("fsync floor", floor))
        for rep in range(self.repeats):
            for i in range(reps):
                for label, fn in rotated(impls, i):
                    out = os.path.join(base, f"{label.replace(' ', '_')}-{rep}-{i}")
                    measure(
                        self.rec,
                        "commit",
                        label,
                        "tddist",
                        lambda fn=fn, out=out: fn(out),
                        repeat=rep,
                        sample=i,
                        quiet=True,
                        cpu=True,
                    )
            if self.rank == 0:
                for label in [lab for lab, _ in impls]:
                    got = [
                        x["metrics"]["time"]
                        for x in self.rec.records
                        if x.get("scenario") == "commit" and x.get("impl") == label and x.get("repeat") == rep
                    ]
                    log(
                        f"[{self.ctx.launcher} N={self.world} rep {rep}] commit         {label:<26} median "
                        f"{C.fmt_seconds(sorted(got)[len(got) // 2])} over {len(got)}"
                    )
            self.clean(base)
            self.mkdirs(base)
        self.clean(base)


def rotated(items: list, k: int) -> list:
    """``items`` starting at position ``k``: each repeat starts with another implementation, so none
    always runs first (or right after the same neighbour) while the order stays interleaved."""
    k %= max(1, len(items))
    return items[k:] + items[:k]


def leaf_map(value) -> dict:
    if isinstance(value, TensorDict):
        return {k: v for k, v in value.items()}
    return value


SCENARIOS = ["save", "async", "load", "reshard", "small", "commit"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True, help="JSON written by run.py")
    ap.add_argument("--result", required=True, help="where rank 0 writes the records (JSON)")
    ap.add_argument("--launcher", choices=["torchrun", "mpi"], default="torchrun")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)
    launcher = "mpiexec" if args.launcher == "mpi" else "torchrun"
    ctx = Ctx("torchrun" if launcher == "torchrun" else "mpi")
    ctx.launcher = launcher
    torch.set_num_threads(1)
    rec = Recorder(ctx, cfg, args.result)
    job = Job(ctx, cfg, rec)
    scenarios = cfg["mpi_scenarios"] if launcher == "mpiexec" else cfg["scenarios"]
    status = 0
    try:
        job.warmup()
        for name in SCENARIOS:
            if name in scenarios:
                t0 = time.perf_counter()
                getattr(job, f"scenario_{name}")()
                if ctx.rank == 0:
                    log(f"[{launcher} N={ctx.world}] scenario {name} done in {time.perf_counter() - t0:.1f} s")
                rec.flush()
    except Exception:
        traceback.print_exc()
        status = 1
    finally:
        rec.flush()
        if status == 0:
            if ctx.rank == 0:
                C.remove(job.work)
            ctx.close()
    sys.exit(status)


if __name__ == "__main__":
    main()
