"""Gloo process groups live to the end of the process: nothing destroys them during interpreter exit.

Why (docs/distributed.md, "Exit"): under FSDP2, torch still references the gloo process group after
``destroy_process_group()`` (DTensor's sharding caches hold the DeviceMesh, whose registry holds the group;
``torch.distributed.nn.functional`` captures ``group.WORLD`` as a default argument when it is first imported
after the group exists), so the group's C++ destructor ran during ``Py_FinalizeEx`` (gdb: ``finalize_modules``
-> gc -> ``~ProcessGroupGloo``), with its worker threads (``pt_gloo_runloop``) and its transport thread
(``gloo_tcp_loop``) still running while the interpreter tears itself down, the other rank perhaps gone. Now
and then a worker aborted there: ``std::terminate`` ("terminate called without an active exception"), SIGABRT.
A group that is never destroyed has no teardown to race: its threads end with the process, as every thread
does. ``destroy_process_group()`` still unregisters the group (accelerate's ``end_training``); only the C++
object outlives it.

`keep_gloo_groups_to_process_end()` records the process's gloo groups when a run starts and, at exit (atexit
runs before the interpreter clears its modules), takes one reference to each that is never given back.

That leaves a rarer abort (CI: once, the FSDP2 resume launch under the 2-process suite; 0 in 24 stress
launches): the kept group's threads still run while ``exit()`` runs C++ static destructors and the other rank
closes its sockets. A script whose exit status matters ends with `exit_without_teardown()` once its files are
written (the test workers do; so does the `causal-adapter` command after a run that kept a gloo group).
"""
from __future__ import annotations

import atexit
import ctypes
import os
import sys

_recorded: list = []  # the gloo groups of this process's runs (their Python objects)
_pinned: set[int] = set()  # ids of the groups already given their permanent reference


def _gloo_groups() -> list:
    """The live process groups whose backend is gloo (the default group and any subgroup)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return []
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or {}) or [dist.group.WORLD]
    out = []
    for group in groups:
        try:
            if "gloo" in str(dist.get_backend(group)):
                out.append(group)
        except (RuntimeError, ValueError):  # a group this rank is not part of
            continue
    return out


def pin_gloo_groups() -> int:
    """Take a permanent reference to every recorded and every live gloo group (once each); the count pinned."""
    count = 0
    for group in _recorded + _gloo_groups():
        if id(group) not in _pinned:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # never given back: no destructor at exit
            _pinned.add(id(group))
            count += 1
    return count


def keep_gloo_groups_to_process_end() -> None:
    """Record this process's gloo groups (call it once a run's process group exists) and pin them at exit."""
    groups = [g for g in _gloo_groups() if all(g is not r for r in _recorded)]
    if not groups:
        return
    if not _recorded:
        atexit.register(pin_gloo_groups)
    _recorded.extend(groups)


def kept_gloo_groups() -> bool:
    """Whether this process recorded a gloo group (`keep_gloo_groups_to_process_end`): its exit could race the
    group's threads."""
    return bool(_recorded)


def exit_without_teardown(code: int = 0) -> None:
    """Flush stdout / stderr and end the process now (`os._exit`): no atexit handlers, no interpreter or C++
    teardown, so no gloo thread can race it. Call it last, after `destroy_process_group()`, every file closed and
    every tracker finished (nothing else is flushed for you)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
