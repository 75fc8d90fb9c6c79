"""Which thread may run parallel torch work: one, the engine's.

Why this module exists (measured, issue 11): a decode step loop that runs on
another thread than the one that loaded the model was 2.2x slower (60 vs 130
tok/s with 2 threads on 2 cores), plain torch ops included; loading *and*
running on one thread, any thread, was fast.

The cause is libgomp, the OpenMP runtime torch's CPU build uses for every
``at::parallel_for``. Each thread that opens a parallel region gets its own
pool of worker threads, kept until that thread exits, and libgomp counts every
worker of every pool in ``gomp_managed_threads``. Its barriers spin before they
sleep, but only ``gomp_throttled_spin_count_var`` times (100, or 1,000 with
``OMP_WAIT_POLICY=active``) instead of ~300,000 once ``gomp_managed_threads >
gomp_available_cpus`` (``do_spin`` in libgomp's ``config/linux/wait.h``). A
model built on thread A and run on thread B makes two pools of two on two
CPUs, so every one of the ~200 parallel regions of a decode step pays a futex
sleep and wake-up at each barrier. Neither ``OMP_WAIT_POLICY`` nor
``GOMP_SPINCOUNT`` reaches the throttled count: tuning them changed nothing.

The rule that keeps it fast: **the thread that runs the engine is the only one
that ever opens a parallel region.** It claims its thread count before it
builds the model; every other thread runs torch single-threaded, so
``at::parallel_for`` runs inline there and no second pool is ever created.

How torch's thread count works, which this relies on: the count is per thread
(``omp_set_num_threads`` sets the calling thread's value), and a thread takes
the process-wide value (the last ``torch.set_num_threads`` anywhere) the first
time a library runs ``at::parallel_for`` on it. "A library": each shared
object keeps its own thread-local "initialised" flag (libtorch_cpu,
libtorch_python, Ember's kernels), and a late first use re-initialises the
thread. So ``claim_for_engine`` initialises every library the engine uses on
the engine thread at once, ``confine_other_threads`` then makes 1 the
process-wide value, and ``keep_engine_count`` (called by the step loop) puts
the engine thread's count back should any other library re-initialise it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

import torch

log = logging.getLogger("ember.engine")

_engine_thread: int | None = None
_engine_count = 0
_warned = False


def claim_for_engine(threads: int, libraries: Iterable[Any] = ()) -> None:
    """Make the calling thread the engine's compute thread with ``threads`` OpenMP threads (0: torch's default).

    ``libraries`` are compiled extension modules with a ``claim_threads()``
    function (Ember's kernels): their per-library initialisation runs now, on
    this thread, while the process-wide count is still this one.
    """
    global _engine_thread, _engine_count
    if threads > 0:
        torch.set_num_threads(threads)
    _engine_count = torch.get_num_threads()  # also initialises libtorch_cpu on this thread
    for library in libraries:
        library.claim_threads()
    _engine_thread = threading.get_ident()


def confine_other_threads() -> None:
    """Run torch single-threaded on the calling thread and on every thread that first uses torch later.

    Call it on a thread that is not the engine's (e.g. the event loop's), once
    the engine thread has claimed its count. It opens no parallel region, so it
    creates no OpenMP pool.
    """
    if threading.get_ident() == _engine_thread:
        raise RuntimeError("confine_other_threads() was called on the engine thread")
    torch.set_num_threads(1)


def run_in_idle_time(idle: bool) -> bool:
    """Schedule the calling thread only in CPU time nothing else wants (Linux ``SCHED_IDLE``), or normally again.

    For background work that shares the cores with the engine (the session
    storage thread). With its compute threads meeting at ~200 barriers a step,
    any thread that takes one of their cores stalls them all: on 2 cores a
    restore paced at half duty still made the other streams' steps 2-5x
    longer. An idle-class thread runs while a compute thread waits at a
    barrier or between steps and is preempted the moment one wakes. Linux
    scheduling is per thread, so this changes the calling thread only. False
    where the platform has no idle class (the caller then paces itself).
    """
    policy = getattr(os, "SCHED_IDLE", None) if idle else getattr(os, "SCHED_OTHER", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:  # e.g. a sandbox that forbids it
        return False
    return True


def keep_engine_count() -> None:
    """On the engine thread: restore its claimed count if a library re-initialised it (logged once)."""
    global _warned
    if _engine_count <= 1 or threading.get_ident() != _engine_thread or torch.get_num_threads() == _engine_count:
        return
    # Not torch.set_num_threads: that would also change the process-wide value other threads take.
    _libgomp().omp_set_num_threads(_engine_count)
    if not _warned:
        _warned = True
        log.warning("a library reset the engine thread's torch thread count; restored it to %d", _engine_count)


def engine_thread() -> int | None:
    """The ident of the thread that claimed the engine's compute threads, if one did."""
    return _engine_thread


def _libgomp() -> ctypes.CDLL:
    # The OpenMP runtime torch loaded (by soname: the loader hands back the loaded copy).
    return ctypes.CDLL("libgomp.so.1")
