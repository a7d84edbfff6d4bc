"""Where a model comes from, checked before anything loads: a local path or a hub id.

``check_model_source`` answers within about a second, so that a typo fails at once and says
so, instead of being taken for a hub id and retried against the network for a minute:

* a name that can only be a local path (absolute, ``~``, ``./`` or ``../``, two or more
  separators, a ``.gguf`` file, a first component that exists here, or a name no hub repository
  can have) must exist: else ``ConfigError`` naming the path and the closest existing name
  beside it;
* a local directory must hold a checkpoint (``config.json``, or the named GGUF file);
* a hub id (``name`` or ``namespace/name``) is fine when the local hub cache has it; else, with
  ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` set, ``ConfigError`` naming the id and the
  variable; else the hub's host must answer a TCP connect within ``probe_timeout_s``.
"""

from __future__ import annotations

import difflib
import os
import re
import socket
import threading
import urllib.parse
from pathlib import Path

from worker.errors import ConfigError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
"""A hub repository id: ``name`` or ``namespace/name`` (no ``--``, no ``..``, checked apart)."""

PROBE_TIMEOUT_S = 1.0


def looks_local(name: str) -> bool:
    """Whether ``name`` can only mean a local path (see the module docstring)."""
    if name.startswith(("/", "~", "./", "../")) or name in (".", ".."):
        return True
    if name.count("/") >= 2 or (os.sep != "/" and os.sep in name):
        return True
    if name.lower().endswith(".gguf"):
        return True
    if not _HUB_ID.fullmatch(name) or "--" in name or ".." in name:
        return True
    first = name.split("/", 1)[0]
    return "/" in name and Path(first).exists()


def _closest(path: Path) -> str | None:
    """The existing name beside the missing one that is most like it (a likely typo)."""
    parent = path.parent if str(path.parent) else Path(".")
    try:
        siblings = [p.name for p in parent.iterdir()]
    except OSError:
        return None
    match = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.6)
    return str(parent / match[0]) if match else None


def check_local(name: str, *, flag: str, gguf_file: str | None = None) -> Path:
    """The existing local checkpoint ``name`` names (a directory, or a ``.gguf`` file)."""
    path = Path(name).expanduser()
    if not path.exists():
        near = _closest(path)
        raise ConfigError(
            f"{flag} {name}: no such file or directory",
            hint=f"did you mean {near}?" if near else "check the path (it is read on this host)",
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(
                f"{flag} {name}: a file, but not a .gguf checkpoint",
                hint="name the checkpoint directory (with its config.json)",
            )
        return path
    if gguf_file is not None:
        if not (path / gguf_file).is_file():
            raise ConfigError(f"{flag} {name}: no GGUF file {gguf_file!r} in it")
        return path
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{flag} {name}: a directory without config.json (not a transformers checkpoint)",
            hint="name the folder that save_pretrained wrote, or a .gguf file",
        )
    return path


def offline() -> bool:
    """Whether hub access is switched off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    if any(os.environ.get(n, "").upper() in {"1", "ON", "YES", "TRUE"} for n in names):
        return True
    from huggingface_hub import is_offline_mode

    return bool(is_offline_mode())


def in_hub_cache(repo_id: str, filename: str = "config.json") -> bool:
    """Whether the local hub cache holds ``filename`` of ``repo_id``."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename)
    return isinstance(found, str)


def hub_reachable(timeout_s: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """``(reachable, host:port)``: whether the hub's host accepts a TCP connection within
    ``timeout_s`` (name resolution included: it runs on a thread that is not waited for)."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urllib.parse.urlparse(endpoint)
    host = parsed.hostname or "huggingface.co"
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True, name="hub-probe")
    thread.start()
    thread.join(timeout_s + 0.2)
    return bool(result and result[0]), f"{host}:{port}"


def check_model_source(
    name: str, *, flag: str = "model", gguf_file: str | None = None, hub: bool = True
) -> str:
    """``"local"`` or ``"hub"`` for a model argument that can load, else ``ConfigError`` (see the
    module docstring). ``flag`` names the argument in the message (``--reference-model``);
    ``hub`` False checks local paths only (a hub id is left to the loader)."""
    if not name or not name.strip():
        raise ConfigError(f"{flag} is empty")
    if looks_local(name) or Path(name).expanduser().exists():
        check_local(name, flag=flag, gguf_file=gguf_file)
        return "local"
    if not hub:
        return "hub"
    if in_hub_cache(name, gguf_file or "config.json"):
        return "hub"
    near = _closest(Path(name))
    local_hint = f"did you mean {near}? " if near else ""
    if offline():
        raise ConfigError(
            f"{flag} {name!r} is not a local path and the local hub cache does not hold it; "
            "HF_HUB_OFFLINE is set, so it is not downloaded",
            hint=local_hint + "pass a local checkpoint directory (or .gguf file), or unset "
            "HF_HUB_OFFLINE",
        )
    ok, where = hub_reachable()
    if not ok:
        raise ConfigError(
            f"{flag} {name!r} is not a local path nor in the local hub cache, and the hub "
            f"({where}) does not answer",
            hint=local_hint + "pass a local checkpoint directory (or .gguf file); set "
            "HF_HUB_OFFLINE=1 to use the local cache only",
        )
    return "hub"


__all__ = ["check_local", "check_model_source", "hub_reachable", "looks_local", "offline"]
