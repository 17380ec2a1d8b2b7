"""No fastqwen process outlives its parent, and no IPC folder outlives its owners (engine/lifeline.py).

The lifeline alone first, in plain Python children (fast): a child ends within a second of a kill -9 of its parent,
also when the parent was already gone before the child set its lifeline up; a parent whose thread that started the
child ends (the parent-death signal's false alarm) keeps its child; the startup sweep removes only folders whose
owner is gone. Then the real server (CPU), with one rank and with two: a kill -9 of the server in the middle of a
stream ends the core, its ranks and multiprocessing's resource tracker, and removes every IPC folder they used; a
kill -9 of the core makes the server exit non-zero and leaves nothing either. The processes and folders are found
from /proc (children, open sockets), not from fastqwen's naming.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
from checkpoints import make_checkpoint
from fastqwen.engine.lifeline import sweep_orphaned_folders
from server_process import ServerProcess

LIFELINE = pathlib.Path(__file__).resolve().parents[1] / "python" / "fastqwen" / "engine" / "lifeline.py"
COMMON = ["--dtype", "float32", "--device", "cpu", "--num-pages", "512", "--page-size", "4", "--skip-warmup"]
GONE_WITHIN_S = 5.0

# A child that sets up its lifeline to the pid in argv[1], says so, and then waits forever. It loads lifeline.py by
# path: importing fastqwen would import torch, seconds per child.
CHILD = f"""
import importlib.util, sys, threading
spec = importlib.util.spec_from_file_location("lifeline", {str(LIFELINE)!r})
lifeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lifeline)
lifeline.end_with_parent(int(sys.argv[1]), "test child")
print("ready", flush=True)
threading.Event().wait()
"""


# ---- /proc --------------------------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return found


def descendants(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


def alive(pid: int) -> bool:
    """Running (a zombie has ended; with its parent killed, nobody may reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][0] != "Z"
    except FileNotFoundError:
        return False


def ipc_folders(pids: list[int]) -> set[str]:
    """The folders of the Unix sockets these processes have open (the bound ends show their path)."""
    paths = {}
    with open("/proc/net/unix") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[7].startswith("/"):
                paths[fields[6]] = fields[7]
    folders = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in paths:
                    folders.add(os.path.dirname(paths[target[8:-1]]))
        except (FileNotFoundError, PermissionError):
            pass
    return folders


def wait_until_gone(pids: list[int], folders: set[str]) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids) and not any(os.path.exists(f) for f in folders):
            return
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    commands = {p: open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ")[:120] for p in left}
    left_folders = [f for f in folders if os.path.exists(f)]
    raise AssertionError(f"{GONE_WITHIN_S} s on: processes {commands}, folders {left_folders}")


# ---- the lifeline alone -------------------------------------------------------------------------------------


def spawn_child(parent_pid: int) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(parent_pid)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    return child


def test_a_child_ends_when_its_parent_is_killed():
    # The parent: a Python process that starts the child (from a thread, as the server starts the core) and waits.
    parent_code = (
        "import os, subprocess, sys, threading\n"
        f"go = lambda: print(subprocess.Popen([sys.executable, '-c', {CHILD!r}, str(os.getpid())]).pid, flush=True)\n"
        "threading.Thread(target=go).start()\n"
        "threading.Event().wait()"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    # The child writes to the same pipe: its pid (from the parent) and its "ready", in either order.
    lines = {parent.stdout.readline().strip(), parent.stdout.readline().strip()}
    assert "ready" in lines, lines
    child = int((lines - {"ready"}).pop())
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_until_gone([child], set())
    finally:
        kill_if_alive(child)


def kill_if_alive(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_parent_gone_before_the_lifeline_is_set_up_ends_the_child_at_once():
    # The expected parent is a process that has already exited: the child's own parent (this process) is another.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(gone.pid)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert child.wait(10) == 1
        assert "is gone; exiting" in child.stderr.read()
        assert child.stdout.read() == ""  # it never got past the lifeline
    finally:
        kill_if_alive(child.pid)


def test_the_end_of_the_thread_that_started_a_child_is_not_its_parents_death():
    """The kernel sends the parent-death signal when the starting *thread* ends: the child must stay."""
    child_holder = {}

    def start():
        child_holder["child"] = spawn_child(os.getpid())

    starter = threading.Thread(target=start)
    starter.start()
    starter.join()
    child = child_holder["child"]
    try:
        with pytest.raises(subprocess.TimeoutExpired):  # the signal has come and gone in far less than this
            child.wait(1.5)
    finally:
        child.kill()
        child.wait()


def test_the_sweep_removes_only_folders_whose_owner_is_gone(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    alive_pid = os.getppid()
    names = {
        f"fastqwen-{gone.pid}-ab_1": False,
        f"fastqwen-tp-{gone.pid}-x9": False,  # owner gone: removed
        f"fastqwen-{alive_pid}-cd": True,
        f"fastqwen-tp-{os.getpid()}-ef": True,  # owner alive, or this process
        "fastqwen-abcdef": True,
        f"other-{gone.pid}-gh": True,
        f"fastqwen-{gone.pid}": True,  # not such a name
    }
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "to_core").write_text("")
    (tmp_path / f"fastqwen-{gone.pid}-file").write_text("")  # a file, not a folder: not ours
    names[f"fastqwen-{gone.pid}-file"] = True
    removed = sweep_orphaned_folders(str(tmp_path))
    assert sorted(removed) == sorted(str(tmp_path / n) for n, kept in names.items() if not kept)
    assert {n: (tmp_path / n).exists() for n in names} == names


# ---- the real server ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("orphans"))
    make_checkpoint(path, tied=True, num_heads=4, num_kv_heads=2, seed=7, max_positions=1024)
    return path


def engine_tree(server: ServerProcess, tp: int) -> tuple[list[int], set[str]]:
    """Every process under the server (the core, its ranks, the resource tracker) and every IPC folder in use."""
    tree = descendants(server.proc.pid)
    folders = ipc_folders([server.proc.pid, *tree])
    assert len(folders) == (1 if tp == 1 else 2), folders
    assert all(f.startswith(tempfile.gettempdir()) for f in folders)
    return tree, folders


def core_pid(server: ServerProcess) -> int:
    """The child that holds sockets (the resource tracker holds none)."""
    cores = [pid for pid in children(server.proc.pid) if ipc_folders([pid])]
    assert len(cores) == 1, cores
    return cores[0]


def in_a_stream(server: ServerProcess, act) -> None:
    """Run act() while a long request is generating (its first tokens have arrived)."""
    body = {"prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        act()


@pytest.mark.parametrize("tp", [1, 2])
def test_kill_9_of_the_server_leaves_no_process_and_no_folder(folder, tp):
    server = ServerProcess(folder, *COMMON, "--tp", str(tp))
    try:
        tree, folders = engine_tree(server, tp)
        assert len(tree) >= tp  # the core and its ranks (and the resource tracker)
        in_a_stream(server, lambda: os.kill(server.proc.pid, signal.SIGKILL))
        assert server.proc.wait(10) == -signal.SIGKILL
        wait_until_gone(tree, folders)
    finally:
        server.stop()


def test_kill_9_of_the_core_ends_the_server_and_leaves_nothing(folder):
    server = ServerProcess(folder, *COMMON, "--tp", "2")
    try:
        tree, folders = engine_tree(server, 2)
        core = core_pid(server)
        assert children(core), "the core's rank 1"
        in_a_stream(server, lambda: os.kill(core, signal.SIGKILL))
        assert server.proc.wait(30) == 1, "the server must exit non-zero so a supervisor restarts it"
        wait_until_gone(tree, folders)
    finally:
        server.stop()
