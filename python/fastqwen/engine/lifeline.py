"""Nothing of fastqwen outlives the process that owns it: a child process ends when its parent does, and the IPC
folders in the temporary directory go with their owners.

Why: the engine core (the server's child) and tensor-parallel ranks 1..N-1 (the core's children) would otherwise live
on after a parent that died abnormally (a segfault, kill -9, the out-of-memory killer): generating for nobody, then
idling forever on the GPU, their ZeroMQ folders left behind.

The invariant: a child started with `end_with_parent(parent_pid)` as its first act runs only while `parent_pid` is its
parent. It notices its parent's death in two ways, which end in the same exit (remove the folders registered with
`remove_when_orphaned`, then `os._exit`):
- the parent-death signal (Linux `prctl(PR_SET_PDEATHSIG)`), at once. The kernel sends it when the *thread* that
  started the child ends, which happens while the parent lives (the server starts the core from a worker thread), so
  the signal is a dedicated one and only wakes the watcher, which checks the parent itself. Its C handler writes to a
  wakeup pipe, so neither a busy main thread nor a blocked one delays the exit.
- the watcher's own check every half second: the portable backup, and the answer to a parent that died before prctl
  ran (the check right after it catches that).
The exit removes first and writes its line after, under an alarm: a full stderr pipe can delay it, never stop it.

Folders are named `fastqwen-[tp-|metrics-]<owner pid>-XXXXXXXX`: whoever survives removes them (the owner on a normal stop, a
child whose parent died, see above), and `ipc_folder` first sweeps those whose owner pid is gone, for the case where
no process of the tree survived to do it (the whole tree killed at once).
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import shutil
import signal
import sys
import tempfile
import threading

_POLL_S = 0.5  # how often the watcher checks its parent without a signal
_EXIT_ALARM_S = 2  # the exit's own bound: whatever blocks, the kernel ends the process after this
_PR_SET_PDEATHSIG = 1
_DEATH_SIGNAL = signal.SIGUSR2  # dedicated: the watcher decides, a stray one changes nothing
_FOLDER_NAME = re.compile(r"fastqwen-(?:tp-|metrics-)?(\d+)-[A-Za-z0-9_]+")

_folders: set[str] = set()  # removed when the parent dies


def remove_when_orphaned(folder: str) -> None:
    """The lifeline removes `folder` if it ends this process (a no-op in a process without one)."""
    _folders.add(folder)


def forget(folder: str) -> None:
    """The owner removed `folder` itself."""
    _folders.discard(folder)


def end_with_parent(parent_pid: int, name: str) -> None:
    """End this process as soon as `parent_pid` stops being its parent. Call it first, from the main thread."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    if sys.platform.startswith("linux"):
        # The handler does nothing: Python's C handler writing to the wakeup pipe is the point.
        signal.signal(_DEATH_SIGNAL, lambda signum, frame: None)
        signal.siginterrupt(_DEATH_SIGNAL, False)  # (the rare false alarm must not interrupt a system call)
        signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
        # Should prctl fail, the watcher's polling still ends the process, half a second later.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(_DEATH_SIGNAL), 0, 0, 0)
    if os.getppid() != parent_pid:  # died before prctl ran: the kernel will not signal for it
        _leave(parent_pid, name)
    threading.Thread(target=_watch, args=(parent_pid, name, wake_read), name="fastqwen-lifeline", daemon=True).start()


def ipc_folder(kind: str) -> str:
    """A new folder for this process's IPC sockets (`kind`: "fastqwen", "fastqwen-tp" or "fastqwen-metrics"), named after its pid, once
    the folders of owners that are gone are removed."""
    sweep_orphaned_folders()
    return tempfile.mkdtemp(prefix=f"{kind}-{os.getpid()}-")


def sweep_orphaned_folders(root: str | None = None) -> list[str]:
    """Remove fastqwen's IPC folders under root (the temporary directory) whose owner process is gone; only this
    user's, only names that carry an owner pid."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        found = _FOLDER_NAME.fullmatch(entry.name)
        if found is None or int(found.group(1)) == os.getpid():
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not _exists(int(found.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _watch(parent_pid: int, name: str, wake_read: int) -> None:
    while True:
        ready, _, _ = select.select([wake_read], [], [], _POLL_S)
        if ready:
            os.read(wake_read, 512)  # any signal Python handles writes here; only the parent's pid decides
        if os.getppid() != parent_pid:
            _leave(parent_pid, name)


def _leave(parent_pid: int, name: str) -> None:
    signal.alarm(_EXIT_ALARM_S)  # SIGALRM's default action ends the process
    for folder in list(_folders):
        shutil.rmtree(folder, ignore_errors=True)
    try:
        os.write(2, f"fastqwen {name} (pid {os.getpid()}): its parent (pid {parent_pid}) is gone; exiting\n".encode())
    except OSError:
        pass
    os._exit(1)
