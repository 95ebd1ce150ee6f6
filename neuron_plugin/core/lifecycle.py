"""Processes that must not outlive the one that started them.

A Neuron runtime holds its NeuronCores until its process exits, so an orphaned engine or
backend runner keeps the device busy for the next server. Linux's parent-death signal
(PR_SET_PDEATHSIG) ends a child when its parent goes, even by SIGKILL."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals, parent_pid: int | None = None) -> None:
    """Have the kernel send `sig` to this process when its parent exits. With
    `parent_pid`, exit now if that parent is already gone (it may die before the call)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)
