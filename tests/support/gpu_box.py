"""An interpreter built like the GPU machine's, for the GPU check's CPU run
(``tests/devtools/test_gpu_check.py``).

The GPU machine's ``python3`` has torch, transformers, peft, msgpack and prometheus-client (and
their own dependencies) and nothing else: no ``test`` extra, no redis-py, no Redis server, no
network, perhaps no pip. ``build()`` makes a venv with exactly ``BOX_PACKAGES`` (torch pinned to
the CPU build this machine carries), then removes pip and setuptools from it, and a wheel folder
made by the check's own downloader (``wheels.download``: the GPU machine's cp312 wheels, plus the
cp311 builds of the few binary ones, since this machine's CPU torch is for Python 3.11). Both
live under ``build/gpu-box/``, named by a digest of the versions, and are reused by later runs; a
fresh clone builds them (about a minute). ``check_env`` and ``offline_argv`` give the check a
``PATH`` without any Redis or Valkey binary, an empty ``HOME`` and ``TMPDIR``, and no network.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from worker.devtools.gpu_check import wheels as gpu_wheels

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "gpu-box"
BOX_PACKAGES: tuple[str, ...] = (
    "torch==2.13.0",
    "transformers==5.24.0",
    "peft==0.21.2",
    "msgpack==1.2.4",
    "prometheus-client==0.26.0",
)
ALSO_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
#: names a PATH must not offer (the GPU machine has no Redis server)
SERVER_BINARIES = ("redis", "valkey", "keydb")
_NOT_TREE = {".git", ".venv", "build", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}


@dataclass(frozen=True)
class Box:
    """The built interpreter and the wheel folder the check is given."""

    python: Path
    wheels: Path
    built_now: bool


def _digest(spec: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def env_key() -> str:
    """Digest of what the environment is made from (the interpreter, the packages)."""
    return _digest({"python": sys.version.split()[0], "packages": BOX_PACKAGES})


def wheels_key() -> str:
    """Digest of what the wheel folder is made from (the list, the tags)."""
    spec = {
        "wheels": list(gpu_wheels.WHEELS),
        "platforms": gpu_wheels.PLATFORMS,
        "python": gpu_wheels.PYTHON_VERSION,
        "also_python": ALSO_PYTHON,
    }
    return _digest(spec)


def _run(cmd: list[str], **kwargs: object) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def _build_env(target: Path) -> None:
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(tmp)])
    py = str(tmp / "bin" / "python")
    _run([py, "-m", "pip", "install", "-q", *BOX_PACKAGES], timeout=900)
    _run([py, "-m", "pip", "uninstall", "-q", "-y", "pip", "setuptools"], timeout=120)
    # venv wrote absolute paths into its scripts; only bin/python (a link) is used, so moving
    # the folder into place is safe
    tmp.rename(target)


def _build_wheels(target: Path) -> None:
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    gpu_wheels.download(tmp, also_python=(ALSO_PYTHON,))
    tmp.rename(target)


def build() -> Box:
    """The environment and the wheel folder, built unless already there."""
    CACHE.mkdir(parents=True, exist_ok=True)
    env, wheels = CACHE / f"env-{env_key()}", CACHE / f"wheels-{wheels_key()}"
    built = False
    if not (env / "bin" / "python").exists():
        _build_env(env)
        built = True
    if not wheels.is_dir():
        _build_wheels(wheels)
        built = True
    for old in CACHE.iterdir():  # builds of other versions (an environment is 1.2 GB)
        if old not in (env, wheels):
            shutil.rmtree(old, ignore_errors=True)
    return Box(env / "bin" / "python", wheels, built)


def server_free_path(folder: Path) -> str:
    """A ``PATH`` of one folder linking every program of this ``PATH`` except Redis-like
    servers and clients (first of each name wins, as the shell would pick)."""
    folder.mkdir(parents=True, exist_ok=True)
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if not entry or not os.path.isdir(entry):
            continue
        for name in sorted(os.listdir(entry)):
            source = Path(entry) / name
            link = folder / name
            if name.startswith(SERVER_BINARIES) or link.exists() or link.is_symlink():
                continue
            if source.is_file() and os.access(source, os.X_OK):
                link.symlink_to(source)
    return str(folder)


def check_env(path: str, home: Path, tmp: Path) -> dict[str, str]:
    """The check's environment: that ``PATH``, an empty ``HOME`` and ``TMPDIR``, no
    ``PYTHONPATH`` (the check puts the tree there itself), no pip configuration, and proxies
    that lead nowhere (for a machine where ``offline_argv`` cannot cut the network)."""
    home.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    dead = "http://127.0.0.1:9"
    return {
        "PATH": path,
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "LANG": "C.UTF-8",
        "PIP_CONFIG_FILE": os.devnull,
        "HTTP_PROXY": dead,
        "HTTPS_PROXY": dead,
        "ALL_PROXY": dead,
        "http_proxy": dead,
        "https_proxy": dead,
        "NO_PROXY": "127.0.0.1,localhost",
    }


def offline_argv() -> list[str]:
    """A prefix that runs a command in a new network namespace with only loopback up (no
    network), or ``[]`` where this machine cannot make one (then the proxies of ``check_env``
    are what keeps the check off the network)."""
    probe = (
        "import socket; s = socket.create_server(('127.0.0.1', 0)); "
        "socket.create_connection(s.getsockname(), timeout=2)"
    )
    for unshare in (["unshare", "-n"], ["unshare", "-rn"]):
        prefix = [*unshare, "sh", "-c", 'ip link set lo up && exec "$0" "$@"']
        if shutil.which("unshare") is None or shutil.which("ip") is None:
            return []
        try:
            proc = subprocess.run(
                [*prefix, sys.executable, "-c", probe], capture_output=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if proc.returncode == 0:
            return prefix
    return []


def tree_files(root: Path = ROOT) -> set[str]:
    """Every file of the tree but ``.git``, ``build`` and bytecode (what the check must not add
    to)."""
    out = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _NOT_TREE]
        rel = Path(folder).relative_to(root)
        out.update(str(rel / f) for f in files)
    return out
