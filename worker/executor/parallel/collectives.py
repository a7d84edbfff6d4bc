"""Every collective of a tensor-parallel group, in one place: which ranks call what, in which order.

A group is ``size`` processes; rank 0 (the leader) alone talks to Redis, ranks 1..N-1
(followers) only compute. Two process groups join them:

* **the TP group**, the default process group (NCCL on CUDA, gloo on CPU): transformers' own
  all-reduces inside the backbone (``o_proj``, ``down_proj``, the vocabulary-split embedding)
  and the LM head's all-gather of per-row statistics. Its collectives only ever run inside a
  batch.
* **the control group**, gloo on the CPU with a timeout of ``CONTROL_TIMEOUT``: the batch
  broadcast (a follower waits in it for as long as the queue is idle), the status vote after
  each forward, the per-call memory peaks. Liveness while idle (a rank stopped, killed or hung)
  comes from the heartbeats and step deadline of ``worker.processes.tp_group``, not from this
  timeout.

Order, per ``run`` call of the leader's ``GroupScorer`` (after the broadcast every rank runs
the same deterministic executor code on the same inputs, so every rank issues the same
collectives in the same order):

======  =====================  =========  =================================================
step    call                   group      who
======  =====================  =========  =================================================
1       ``send_call(call)``    control    rank 0; ranks 1..N-1 are in ``receive_call()``
2       per forward (``BatchRunner``: each planned batch, each fallback retry, each OOM half):
2a      backbone all-reduces   TP         all ranks, inside transformers' forward
2b      ``agree(status)``      control    all ranks, after the local LM-head fold and before
                                          anything is combined: an all-reduce of the worst
                                          status and, only when a rank failed, an all-gather
                                          of what failed (every rank then raises alike)
2c      ``combine_rows(st)``   TP         all ranks: one all-gather of per-row statistics
                                          ``[rows, C]`` (never logits)
2d      ``agree(status)``      control    all ranks, at the end of the forward (the reward
                                          model's forward runs between 2c and 2d)
3       ``gather_peaks(peak)`` control    all ranks, once per call: each rank's peak memory
======  =====================  =========  =================================================

A forward without an LM head (reward only) skips 2b and 2c. A rank whose forward raises joins
the next ``agree`` with its failure, whichever of 2b/2d the others reach. ``send_call(None)``
ends the followers' loop. A collective that itself fails (a peer gone: gloo's "Connection closed
by peer", an NCCL error) calls ``fatal``, which takes the process down at once: the leader's
batch is then never acked and another worker reclaims it.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

__all__ = [
    "CONTROL_TIMEOUT",
    "GROUP_FAULT_EXIT",
    "Comm",
    "GroupSpec",
    "init_group",
    "is_collective_failure",
]

CONTROL_TIMEOUT = datetime.timedelta(days=30)
"""The control group's timeout: long enough that an idle queue never trips it."""

GROUP_FAULT_EXIT = 75
"""Exit code of a rank that takes its group down (``EX_TEMPFAIL``: restart it)."""

#: Status codes of ``agree``, worst last (an all-reduce MAX picks the worst).
OK, FAILED = 0, 1


@dataclass(frozen=True)
class GroupSpec:
    """Where one rank stands: its ``rank`` of ``size``, the rendezvous (the leader's
    ``TCPStore`` at ``host:port``), the device type (``cuda`` or ``cpu``) and the devices of
    every rank as shown to operators (``info``, heartbeats)."""

    rank: int
    size: int
    host: str
    port: int
    device_type: str
    devices: tuple[str, ...]
    timeout_s: float = 1800.0

    @property
    def device(self) -> str:
        """This rank's device: ``cuda:<rank>`` on CUDA, else ``cpu``."""
        return f"cuda:{self.rank}" if self.device_type == "cuda" else "cpu"


#: What the message of an error raised by a failed collective says (gloo raises a plain
#: ``RuntimeError``: "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer").
_COLLECTIVE_WORDS = ("gloo", "NCCL", "ProcessGroup", "Connection closed by peer", "c10d")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from a collective of the group (a peer gone, a broken group): such
    a rank cannot vote with the others any more, only take the group down."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(w in text for w in _COLLECTIVE_WORDS)


def _fatal(reason: str) -> NoReturn:
    log.error("tensor-parallel group fault: %s; taking the group down", reason)
    logging.shutdown()
    os._exit(GROUP_FAULT_EXIT)


def use_loopback(host: str) -> None:
    """A group on one machine (its store on a loopback address) talks over the loopback
    interface: gloo and NCCL's bootstrap otherwise bind to the address the hostname resolves
    to, which a host without a network (or a network namespace with only ``lo``) does not have,
    and the ranks then wait for each other forever. An interface set by the operator
    (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) is kept."""
    if host not in ("127.0.0.1", "localhost", "::1"):
        return
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if names:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", names[0])
        os.environ.setdefault("NCCL_SOCKET_IFNAME", names[0])


def init_group(spec: GroupSpec, store: Any = None) -> Comm:
    """Join the group: the default (TP) process group over the leader's ``TCPStore`` (``store``
    on the leader, which created it; a client on the others) and the gloo control group.
    Every rank calls it once, before loading."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    use_loopback(spec.host)
    if store is None:
        store = dist.TCPStore(spec.host, spec.port, spec.size, is_master=False, timeout=timeout)
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    if spec.device_type == "cuda":
        torch.cuda.set_device(spec.rank)
    dist.init_process_group(
        backend, store=store, rank=spec.rank, world_size=spec.size, timeout=timeout
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Comm(spec, control, store)


class Comm:
    """The group's collectives (module docstring), timed by kind (``take_seconds``).

    ``fatal(reason)`` is called when a collective fails; the default logs and ends the process
    with ``GROUP_FAULT_EXIT``.
    """

    def __init__(
        self,
        spec: GroupSpec,
        control: Any,
        store: Any = None,
        fatal: Callable[[str], NoReturn] = _fatal,
    ) -> None:
        self.spec = spec
        self.rank, self.size = spec.rank, spec.size
        self.control = control
        self.store = store  # the leader's server stays alive while the group is
        self.fatal = fatal
        self._seconds: dict[str, float] = {}

    @contextmanager
    def _timed(self, kind: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        except Exception as exc:  # a peer gone or a broken group: nothing can continue
            self.fatal(f"rank {self.rank}: {kind} collective failed: {type(exc).__name__}: {exc}")
            raise  # a test's fatal that returns: the caller still sees the failure
        finally:
            self._seconds[kind] = self._seconds.get(kind, 0.0) + time.perf_counter() - started

    def take_seconds(self) -> dict[str, float]:
        """Seconds spent in each kind of collective since the last call (then reset)."""
        out, self._seconds = self._seconds, {}
        return out

    # ------------------------------------------------------------------ step 1: the call
    def send_call(self, call: Any) -> None:
        """Rank 0: broadcast ``call`` (any picklable object; ``None`` stops the followers)."""
        assert self.rank == 0, "only the leader sends calls"
        with self._timed("broadcast"):
            dist.broadcast_object_list([call], src=0, group=self.control)

    def receive_call(self) -> Any:
        """Ranks 1..N-1: wait (as long as the queue is idle) for rank 0's next call."""
        assert self.rank != 0, "the leader sends calls"
        box: list[Any] = [None]
        with self._timed("broadcast"):
            dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    # ------------------------------------------------------------------ steps 2b/2d: the vote
    def agree(self, failure: Any = None) -> list[Any]:
        """All ranks: ``failure`` is ``None`` when this rank's forward went well, else a
        picklable description of what failed. Returns every rank's failure (``None`` for
        the ranks that went well), or ``[]`` when no rank failed (one all-reduce then)."""
        flag = torch.tensor([OK if failure is None else FAILED], dtype=torch.int32)
        with self._timed("vote"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
            if int(flag.item()) == OK:
                return []
            every: list[Any] = [None] * self.size
            dist.all_gather_object(every, failure, group=self.control)
        return every

    # ------------------------------------------------------------------ step 2c: the head
    def combine_rows(self, stats: torch.Tensor) -> torch.Tensor:
        """All ranks: every rank's per-row statistics ``[rows, C]`` float32 (same shape on
        every rank) stacked as ``[size, rows, C]``, on the TP group (NCCL: on the device)."""
        parts = [torch.empty_like(stats) for _ in range(self.size)]
        with self._timed("head"):
            dist.all_gather(parts, stats.contiguous())
        return torch.stack(parts)  # [W, rows, C]

    # ------------------------------------------------------------------ step 3: the peaks
    def gather_peaks(self, peak_bytes: int) -> tuple[int, ...]:
        """All ranks: every rank's peak memory of the call, rank order."""
        mine = torch.tensor([int(peak_bytes)], dtype=torch.int64)
        parts = [torch.zeros_like(mine) for _ in range(self.size)]
        with self._timed("peaks"):
            dist.all_gather(parts, mine, group=self.control)
        return tuple(int(p.item()) for p in parts)

    def close(self) -> None:
        """Leave the process groups (after the followers stopped)."""
        try:
            dist.destroy_process_group()
        except Exception:  # already gone or never made: nothing to free
            log.debug("destroy_process_group failed", exc_info=True)
