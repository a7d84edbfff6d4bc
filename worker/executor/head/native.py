"""The compiled LM-head tile kernel (``native_tiles.c``): built on first use, cached, optional.

``tiles.py`` reduces each ``[rows, tile]`` slice of the logits with a few torch ops per tile
(scale, max, subtract, exp2, sum; for teacher outputs also the entropy product, the top-k
candidate search and the tail). Each op is one more pass over the slice and a few microseconds
of dispatch, which adds up over the 126 tiles of a 128k vocabulary. ``native_tiles.c`` does
the whole fold of one row in one read while the row sits in L1, the top-k as a min-heap per
row. It is compiled here with the system C compiler (``$CC``, else ``cc``) the first time a
process asks for it, with ``-O3 -march=native``, into a cache directory
(``$SCORING_WORKER_CACHE``, else ``$XDG_CACHE_HOME/scoring-worker``, else
``~/.cache/scoring-worker``; a per-user directory under the temp directory when that one cannot be
written), keyed by the source, the flags, the compiler and this CPU, so
later processes load it in milliseconds.

When there is no compiler, the build fails, or ``SCORING_WORKER_NATIVE=0`` is set, ``kernel()``
returns None (logged once) and the tiles take their torch path: same outputs (within float32
rounding: the kernel's ``exp2`` is a polynomial, ~1e-7 relative), slower.

The library is loaded after torch, so its ``libgomp.so.1`` resolves to the one torch already
loaded: its parallel rows run on torch's own OpenMP threads, ``torch.get_num_threads()`` of
them, instead of a second pool competing for the same cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["ENV", "NativeTiles", "build", "kernel"]

log = logging.getLogger(__name__)

ENV = "SCORING_WORKER_NATIVE"
"""Environment switch: ``0`` (or ``off``/``false``/``no``) keeps the torch path everywhere."""

SOURCE = Path(__file__).with_name("native_tiles.c")
FLAGS = (
    "-O3",
    "-march=native",
    # the parts of -ffast-math the vectorised sums and max need; not -ffast-math itself, whose
    # link step adds crtfastmath.o, which turns on flush-to-zero for the whole process (torch's
    # and numpy's subnormals would read as 0), nor -ffinite-math-only (-inf logits stay -inf)
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    # no fused multiply-add: z * factor rounds the same in every loop (logps-only and teacher
    # passes give bit-identical log-probs)
    "-ffp-contract=off",
    "-fopenmp",
    "-fPIC",
    "-shared",
)
ABI = 1
BUILD_TIMEOUT_S = 120.0

_lock = threading.Lock()
_loaded: NativeTiles | None = None
_tried = False


class NativeTiles:
    """The loaded kernel: ``reduce`` folds one tile in (see ``native_tiles.c``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        if lib.sw_abi() != ABI:
            raise OSError(f"{path}: kernel ABI {lib.sw_abi()}, expected {ABI}")
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn = lib.sw_tile_reduce
        fn.argtypes = [p, i64, i64, i64, ctypes.c_float, p, p, p, p, p, p, i64, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def reduce(
        self,
        z: torch.Tensor,
        v0: int,
        factor: float,
        m: torch.Tensor,
        s: torch.Tensor,
        ent: torch.Tensor | None = None,
        heap: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Fold ``z`` ``[n, t]`` (float32 CPU, rows contiguous; vocabulary ids ``v0 ..``) times
        ``factor`` into ``m`` / ``s`` / ``ent`` ``[n]`` and ``heap`` (values ``[n, k]``, ids
        ``[n, k]`` int64, tail ``[n]``), all float32 contiguous CPU tensors updated in place."""
        n, t = z.shape
        assert z.dtype == torch.float32 and z.device.type == "cpu" and z.stride(1) == 1
        values, ids, tail = heap if heap is not None else (None, None, None)
        k = values.shape[1] if values is not None else 0
        rc = self._fn(
            z.data_ptr(),
            n,
            t,
            z.stride(0),
            factor,
            m.data_ptr(),
            s.data_ptr(),
            _ptr(ent),
            _ptr(values),
            _ptr(ids),
            _ptr(tail),
            k,
            v0,
            torch.get_num_threads(),
        )
        if rc:
            raise ValueError(f"native tile kernel refused a [{n}, {t}] tile (factor {factor})")


def _ptr(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


def enabled() -> bool:
    """Whether ``SCORING_WORKER_NATIVE`` allows the kernel (anything but 0/off/false/no)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def cache_dir() -> Path:
    """Where built kernels are kept."""
    if os.environ.get("SCORING_WORKER_CACHE"):
        return Path(os.environ["SCORING_WORKER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "scoring-worker"


def _writable(directory: Path) -> Path:
    """``directory``, or a per-user one under the temp directory when it cannot be written
    (a read-only home, as in a container with a read-only root filesystem)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if os.access(directory, os.W_OK):
            return directory
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"scoring-worker-{os.getuid()}"
    log.info("kernel cache %s is not writable; using %s", directory, fallback)
    return fallback


def _cpu_key() -> str:
    """The CPU's model and feature flags (``-march=native`` builds for exactly these)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def build(directory: Path | None = None) -> Path:
    """Compile ``native_tiles.c`` (or reuse a cached build); returns the library's path.
    Raises ``OSError`` (no compiler, a failed or timed-out build)."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler ({cc!r} is not on PATH)")
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise OSError(f"{cc} --version: {e}") from e
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu_key().encode()])
    ).hexdigest()[:16]
    directory = directory or _writable(cache_dir())
    target = directory / f"native_tiles-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=directory)
    os.close(fd)
    cmd = [cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
        )
        if done.returncode:
            raise OSError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
        os.replace(tmp, target)  # atomic: processes building at once each install a whole file
    except subprocess.TimeoutExpired as e:
        raise OSError(f"{' '.join(cmd)} timed out after {BUILD_TIMEOUT_S:.0f} s") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def kernel() -> NativeTiles | None:
    """The kernel, built and loaded once per process; None when it is switched off
    (``SCORING_WORKER_NATIVE=0``) or cannot be built here (the reason is logged once)."""
    global _loaded, _tried
    if not enabled():
        return None
    with _lock:
        if not _tried:
            _tried = True
            try:
                _loaded = NativeTiles(build())
                log.info("native LM-head tile kernel: %s", _loaded.path)
            except OSError as e:
                log.warning("native LM-head tile kernel unavailable, using torch ops: %s", e)
        return _loaded
