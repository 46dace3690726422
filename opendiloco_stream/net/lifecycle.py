"""Running a peer cleanly: one process group, signals as a flag, no orphaned p2pd.

hivemind starts helper processes behind your back: the DHT forks a process that spawns
``p2pd``. If the training process dies on a signal, those keep running (seen
with hivemind 1.1.12; docs/architecture.md, "Processes"). The pieces here keep them together and
take them down:

* :func:`new_session` puts a non-interactive peer in its own session, so a launcher can kill the
  peer and every descendant with one ``os.killpg``.
* :class:`GracefulShutdown` turns SIGINT/SIGTERM into a flag the training loop checks at safe
  points (after an inner step, never mid-sync); a second signal kills the descendants and exits.
* :func:`kill_process_tree` finds descendants through ``/proc`` (not through process groups, which
  a child may leave) and sends SIGTERM, then SIGKILL to whatever is left after ``timeout``;
  :func:`kill_session` also stops the members of a launched peer's session whose parent is gone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import threading
import time
from types import FrameType
from typing import Iterable, NoReturn, Optional


def _stat_map(field: int) -> dict[int, int]:
    """pid -> the ``field``-th number after the state in /proc/PID/stat (0: ppid, 1: process group, 2: session id)."""
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited while we were scanning
        # "pid (comm) state ppid pgrp session ...": comm may contain spaces and parentheses, so split after the last ')'
        fields = stat[stat.rfind(b")") + 2:].split()
        out[int(entry)] = int(fields[1 + field])
    return out


def _ppid_map() -> dict[int, int]:
    """pid -> parent pid for every process visible in /proc."""
    return _stat_map(0)


def session_members(sid: int) -> list[int]:
    """Every live process of session ``sid``, orphans re-parented away from its leader included."""
    return [pid for pid, session in _stat_map(2).items() if session == sid and is_running(pid)]


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children first, then their children, ...)."""
    children: dict[int, list[int]] = {}
    for child, parent in _ppid_map().items():
        children.setdefault(parent, []).append(child)
    out, seen, frontier = [], {pid}, [pid]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, ()) if c not in seen]
        seen.update(frontier)
        out.extend(frontier)
    return out


def process_name(pid: int) -> Optional[str]:
    """The executable name of ``pid`` (``comm``), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait until every pid has exited or ``timeout`` passed; return those still running.

    Uses pidfds (readable when the process terminates), so this sleeps on the event itself.
    """
    deadline = time.monotonic() + timeout
    fds: dict[int, int] = {}
    polled: list[int] = []
    for pid in pids:
        if not is_running(pid):
            continue
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
        except OSError:  # no pidfd support (old kernel, seccomp): fall back to polling this one
            polled.append(pid)
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    try:
        while True:
            polled = [p for p in polled if is_running(p)]
            remaining = deadline - time.monotonic()
            if (not fds and not polled) or remaining <= 0:
                break
            wait_ms = remaining * 1000 if not polled else min(remaining * 1000, 50)
            for fd, _ in poller.poll(wait_ms):
                poller.unregister(fd)
                os.close(fd)
                del fds[fd]
    finally:
        for fd in fds:
            os.close(fd)
    return [p for p in [*fds.values(), *polled] if is_running(p)]


def terminate_pids(pids: Iterable[int], timeout: float = 5.0) -> list[int]:
    """SIGTERM each pid, SIGKILL those still running after ``timeout``; return the ones killed."""
    pids = [p for p in pids if is_running(p)]
    _send(signal.SIGTERM, pids)
    stubborn = wait_gone(pids, timeout)
    _send(signal.SIGKILL, stubborn)
    wait_gone(stubborn, 1.0)
    return stubborn


def _send(sig: int, pids: Iterable[int]) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_process_tree(pid: int, timeout: float = 5.0, *, include_root: bool = True) -> list[int]:
    """SIGTERM ``pid`` and all its descendants, SIGKILL what is left after ``timeout``.

    The tree is collected before any signal is sent: once a parent dies its children are
    re-parented and could no longer be found from ``pid``. Returns the pids that needed SIGKILL.
    """
    tree = descendants(pid) + ([pid] if include_root else [])
    killed = terminate_pids(tree, timeout)
    # children forked after our scan (e.g. a DHT process starting p2pd right now)
    late = [p for p in descendants(pid) if p not in tree]
    return killed + terminate_pids(late, min(timeout, 1.0))


def kill_session(leader: int, timeout: float = 5.0, *, hard: bool = False) -> list[int]:
    """Stop the session ``leader`` leads (a peer started with ``start_new_session``) and every
    descendant: SIGTERM then SIGKILL after ``timeout``, or SIGKILL at once with ``hard`` (a crash).

    Members are found by session id as well as by parentage, so a helper whose parent already
    exited (a p2pd re-parented to init) is stopped too. Returns the pids signalled.
    """
    pids = sorted(set(session_members(leader)) | set(descendants(leader)) | ({leader} if is_running(leader) else set()))
    if hard:
        _send(signal.SIGKILL, pids)
        wait_gone(pids, timeout)
    else:
        terminate_pids(pids, timeout)
    return pids


def daemons(name: str = "p2pd") -> set[int]:
    """Pids of the ``p2pd`` processes descending from this process."""
    return {p for p in descendants(os.getpid()) if process_name(p) == name}


def kill_stray_daemons(existing: Iterable[int] = (), timeout: float = 2.0, name: str = "p2pd") -> list[int]:
    """Terminate ``p2pd`` descendants of this process not in ``existing`` (a last sweep before a command ends).

    Pass ``daemons()`` taken when the command started, so that daemons of other components of the
    same process are spared. Normally finds nothing: each node stops its own daemon; this catches
    one started by a dial probe or a node creation that was interrupted midway.
    """
    strays = sorted(daemons(name) - set(existing))
    terminate_pids(strays, timeout)
    return strays


def new_session() -> bool:
    """Make this process the leader of a new session and process group, where that is safe.

    A peer launched by a script or a test then forms one process group with its DHT and
    p2pd children, and ``os.killpg(os.getpgid(pid), ...)`` reaches all of them. An interactive job
    is left alone: the shell already gave it its own process group, and leaving the terminal's
    session would make Ctrl+C stop reaching it. Returns True if a new session was created.
    """
    try:
        tty = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        tty = None
    if tty is not None:
        try:
            interactive = os.tcgetpgrp(tty) == os.getpgrp()
        except OSError:
            interactive = False
        finally:
            os.close(tty)
        if interactive:
            return False
    try:
        os.setsid()
        return True
    except PermissionError:  # already a process group leader: it has its own group already
        return False


class GracefulShutdown:
    """Context manager: SIGINT/SIGTERM set a flag; a second signal kills our descendants and exits.

    ::

        with GracefulShutdown() as stop:
            while not stop.requested:
                train_one_step()          # the loop stops at a safe point
            save_checkpoint()

    Handlers are installed only in the main thread (Python delivers signals there). The handler
    takes no lock (a lock held by the interrupted code would deadlock it): it sets a flag and
    writes a byte to a pipe that :meth:`wait` selects on. Processes forked while it is active (the
    the DHT) inherit the handler; in them it passes SIGTERM on to their own children and
    then dies of the signal, so killing a helper never orphans its p2pd.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM), *, kill_timeout: float = 0.0):
        self.signals = tuple(signals)
        self.signum: Optional[int] = None
        self._flag = False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous: dict[int, object] = {}
        self._owner_pid = os.getpid()
        self._kill_timeout = kill_timeout

    @property
    def requested(self) -> bool:
        """True once a shutdown signal arrived (or :meth:`request` was called)."""
        return self._flag

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a shutdown as if ``signum`` had arrived (for code paths that decide to stop)."""
        self.signum = self.signum or signum
        self._set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until a shutdown is requested or ``timeout`` passed; return :attr:`requested`."""
        if not self._flag:
            select.select([self._read_fd], [], [], timeout)  # the byte is never read: every waiter wakes
        return self._flag

    def _set(self) -> None:
        self._flag = True
        try:
            os.write(self._write_fd, b"!")
        except (BlockingIOError, OSError):  # pipe full or closed: the flag is what counts
            pass

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if os.getpid() != self._owner_pid:
            # a forked helper (the DHT process): pass the signal on to its own children (p2pd), then
            # die as it would have without us, instead of orphaning them
            _send(signal.SIGTERM, descendants(os.getpid()))
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self._flag:
            self._exit_now(signum)
        self.signum = signum
        self._set()

    def _exit_now(self, signum: int) -> None:
        # os.write, not print: the interrupted code may hold the stderr buffer's lock
        os.write(2, f"received {signal.Signals(signum).name} twice: stopping now\n".encode())
        kill_process_tree(os.getpid(), self._kill_timeout, include_root=False)
        os._exit(128 + signum)

    def __enter__(self) -> "GracefulShutdown":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __del__(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


# ---------------------------------------------------------------------------------- die with parent
_forking_from_main_thread = False
_pdeathsig_installed = False


def _before_fork() -> None:
    global _forking_from_main_thread
    _forking_from_main_thread = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    # PR_SET_PDEATHSIG fires when the *thread* that forked exits: only safe for forks from the main
    # thread, which lives as long as the process.
    if not _forking_from_main_thread:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() == 1:  # the parent died between fork and prctl
            os.kill(os.getpid(), signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def die_with_parent() -> None:
    """Make every Python process forked from now on (hivemind's DHT process) get
    SIGTERM when this process dies, even by SIGKILL, so they can stop their p2pd and exit.

    Linux only (``prctl(PR_SET_PDEATHSIG)``); a no-op elsewhere. Call once, early, in the peer.
    """
    global _pdeathsig_installed
    if _pdeathsig_installed or not sys.platform.startswith("linux"):
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _pdeathsig_installed = True


def exit_without_teardown(code: int) -> NoReturn:
    """End the process now with ``code``, without the interpreter's teardown: logging is shut down
    and stdout/stderr flushed first (the caller closed its files, DHT and averagers)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
