"""Output folders: one writer at a time (lock files with stale-lock detection), nothing left behind
by a run that failed before writing anything.

A command that writes into a folder (``generate --data``, ``pipeline`` run folders, ``export --out``,
``eval --out``) claims it with :func:`claim_output_dir`:

* a lock file ``<folder>/.specstop-locks/<role>.lock`` records the holder's pid, host and start
  time. A second run finds a live holder and refuses with one line naming it; a lock whose process
  is gone (killed, crashed, rebooted: pid not running, or running but started later - a reused
  pid) is stale and taken over;
* roles let cooperating writers share a folder: ``generate`` workers of one job each hold
  ``worker-<i>-of-<n>``; a single-process run (or ``--merge``) holds the whole folder, so it
  conflicts with any live worker and vice versa;
* if the command fails and the folder it created holds nothing but the lock, the folder is removed.

Every writing command also calls :func:`check_writable` on its outputs before the long work starts
(a read-only location, missing permission or a full disk is one line, not a traceback an hour
later), and writes single files with :func:`atomic_write_text` (never half a file).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from specstop.errors import UserError

log = logging.getLogger(__name__)

LOCK_DIR = ".specstop-locks"
EXCLUSIVE = "all"


class FolderBusyError(UserError):
    """Another live specstop process is writing the folder."""


def _process_start(pid: int) -> float | None:
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # no such process, no permission, no psutil
        return None


def holder_alive(info: dict) -> bool:
    """Is the process recorded in a lock file still running (on this host)?

    A lock from another host cannot be checked and counts as alive (delete it by hand if that
    run is gone). A pid that is running but started after the lock was written is a reused pid.
    """
    if info.get("host") != socket.gethostname():
        return True
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    started = _process_start(pid)
    if started is None:
        return False
    recorded = info.get("process_start")
    return not (isinstance(recorded, (int, float)) and started > recorded + 1.0)


def _read_lock(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _create_with(path: Path, info: dict) -> bool:
    """Create the lock file ``path`` holding ``info``, or return False when it exists.

    The record is written to a private name first and hard-linked into place, so the lock file
    never exists empty: a second run reading it half-written would take it for a stale lock and
    take it over, and both runs would write the folder. (Where the file system has no hard links
    the file is created exclusively and filled at once, as before.)
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(json.dumps(info))
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here (some network or FUSE file systems)
            pass
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _read_settled_lock(path: Path, wait: float = 1.0) -> dict | None:
    """The lock's record; an unreadable one is read again for up to ``wait`` seconds (a writer
    without hard links fills it a moment after creating it) before it counts as garbage."""
    deadline = time.monotonic() + wait
    while True:
        info = _read_lock(path)
        if info is not None or not path.exists() or time.monotonic() >= deadline:
            return info
        time.sleep(0.05)


def _remove_stale(path: Path, seen: dict | None) -> None:
    """Remove the stale lock ``path`` whose record was ``seen`` - but not a live lock another run
    created after we looked (it is moved aside atomically, checked, and put back if it is not the
    stale one)."""
    aside = path.with_name(f".{path.name}.stale-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # someone else removed it
    try:
        if _read_lock(aside) != seen:
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
            except OSError:  # no hard links here
                if not path.exists():
                    os.rename(aside, path)
    finally:
        aside.unlink(missing_ok=True)


def _conflicts(mine: str, other: str) -> bool:
    """Do two roles write the same shards? Workers of one job (same n, other i) do not."""
    if mine == EXCLUSIVE or other == EXCLUSIVE or mine == other:
        return True
    a, b = mine.split("-of-"), other.split("-of-")
    return len(a) != 2 or len(b) != 2 or a[1] != b[1]


def _describe(info: dict | None, path: Path) -> str:
    if not info:
        return f"lock file {path}"
    return (
        f"`{info.get('command', 'specstop')}` (pid {info.get('pid')} on {info.get('host')}, "
        f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info.get('created', 0)))})"
    )


class FolderLock:
    """An advisory lock on ``folder`` for one role (see the module docstring)."""

    def __init__(self, folder: str | Path, role: str = EXCLUSIVE, command: str = "specstop") -> None:
        self.folder = Path(folder)
        self.role = role
        self.command = command
        self.path = self.folder / LOCK_DIR / f"{role}.lock"
        self.held = False
        self._mine: dict | None = None

    def acquire(self) -> FolderLock:
        """Take the lock or raise :class:`FolderBusyError` naming the live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {
            "pid": os.getpid(), "host": socket.gethostname(), "process_start": _process_start(os.getpid()),
            "created": time.time(), "command": self.command, "role": self.role,
        }
        for _attempt in range(3):
            if _create_with(self.path, me):
                self.held = True
                self._mine = me
                break
            info = _read_settled_lock(self.path)
            if info is not None and info.get("pid") == os.getpid() and info.get("host") == me["host"]:
                return self  # re-entrant: this process already holds it (the outer claim releases it)
            if info is not None and holder_alive(info):
                raise FolderBusyError(self._busy_message(info, self.path))
            log.info("removing a stale lock of a process that is gone: %s", _describe(info, self.path))
            _remove_stale(self.path, info)
        else:  # pragma: no cover - other processes kept taking the stale lock between our attempts
            raise FolderBusyError(self._busy_message(_read_lock(self.path), self.path))
        # Cooperating roles hold other lock files: refuse when a live one writes the same shards.
        for other in sorted(self.path.parent.glob("*.lock")):
            if other == self.path or not _conflicts(self.role, other.stem):
                continue
            info = _read_settled_lock(other)
            if info is None or not holder_alive(info):
                _remove_stale(other, info)
                continue
            self.release()
            raise FolderBusyError(self._busy_message(info, other))
        return self

    def _busy_message(self, info: dict | None, path: Path) -> str:
        return (
            f"{self.folder} is being written by another run: {_describe(info, path)}; wait for it to finish or "
            f"use another output folder (if that process is gone on another machine, delete {path})"
        )

    def release(self) -> None:
        if self.held:
            # Only our own lock: one another run took over (it judged ours stale) is theirs.
            if _read_lock(self.path) == self._mine:
                self.path.unlink(missing_ok=True)
            self.held = False
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()  # only when no other lock is left

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _only_locks_left(folder: Path) -> bool:
    return all(p.name == LOCK_DIR for p in folder.iterdir())


@contextlib.contextmanager
def claim_output_dir(folder: str | Path, *, role: str = EXCLUSIVE, command: str = "specstop") -> Iterator[Path]:
    """Create (if needed) and lock ``folder`` for this run; remove it again if the run fails before
    writing anything into a folder it created.

    Args:
        folder: the output folder.
        role: ``all`` (this run writes the whole folder) or ``worker-<i>-of-<n>``.
        command: shown to a second run that finds the folder busy.

    Yields:
        The folder as a Path.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"output folder {folder} is a file; give a folder path")
    check_writable(folder, "output folder")
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    lock = FolderLock(folder, role, command)
    try:
        lock.acquire()
    except BaseException:
        if created:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    try:
        yield folder
    except BaseException:
        lock.release()
        if created and folder.is_dir() and _only_locks_left(folder):
            shutil.rmtree(folder, ignore_errors=True)
        raise
    else:
        lock.release()


# ---------------------------------------------------------------------------- can this run write?
# errno values that mean "this location cannot take our output" (as opposed to a bug).
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
PROBE_BYTES = 4096  # a probe that writes data, so a full disk fails the check, not hours later


def write_error_message(err: OSError, doing: str = "writing") -> str | None:
    """One line for an OSError that means the output location cannot be written, else None (a bug).

    Args:
        err: the error (``errno`` and ``filename`` are read).
        doing: what was being done (``writing``, ``creating``).
    """
    if err.errno == errno.ENAMETOOLONG:
        return too_long_message(err)
    if err.errno not in WRITE_ERRNOS:
        return None
    name = err.filename or _file_being_written(err)
    where = f" {name}" if name else ""
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        free = _free_bytes(name)
        room = f" ({free // (1 << 20)} MB free there)" if free is not None else ""
        return (f"no space left on the device (or over quota) while {doing}{where}{room}; free space or choose an "
                "output location on another disk, then rerun the same command (finished work is kept)")
    reason = "a read-only file system" if err.errno == errno.EROFS else "permission denied"
    return (f"cannot write{where}: {reason}; choose a writable output location (or fix its permissions), "
            "then rerun the same command")


@contextlib.contextmanager
def naming_writes(path: str | Path) -> Iterator[None]:
    """Give a write error that names no file (``write()`` on a full disk, a library's writer) the
    name ``path``, so its one line (:func:`write_error_message`) says which output failed.

    Every writer of specstop's outputs runs inside it (:func:`atomic_write_text`, dataset shards).
    """
    try:
        yield
    except OSError as err:
        if err.filename is not None or err.errno not in WRITE_ERRNOS:
            raise
        raise OSError(err.errno, err.strerror or os.strerror(err.errno), str(path)) from err


def _file_being_written(err: BaseException) -> str | None:
    """The file an unnamed write error came from: the innermost open-for-writing file object in its
    traceback's frames (a write outside :func:`naming_writes`), or None."""
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in list(frame.f_locals.values()):
            name, mode = getattr(value, "name", None), getattr(value, "mode", None)
            if isinstance(name, str) and isinstance(mode, str) and any(c in mode for c in "wax+"):
                return name
    return None


def _free_bytes(name: str | None) -> int | None:
    """Free bytes on the file system that holds ``name`` (its nearest existing folder), or None."""
    if not name:
        return None
    folder = Path(name).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def too_long_message(err: OSError) -> str:
    """One line for ``ENAMETOOLONG``: a path (given, or made from a given one) the OS cannot take."""
    name = str(err.filename or "")
    try:
        name_max = os.pathconf(Path(name).parent if name else ".", "PC_NAME_MAX")
        path_max = os.pathconf(Path(name).parent if name else ".", "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    longest = max((len(part.encode()) for part in Path(name).parts), default=0)
    shown = name if len(name) <= 120 else f"{name[:60]}...{name[-40:]} ({len(name)} characters)"
    what = (f"a name in it has {longest} bytes" if longest > name_max else f"it has {len(name.encode())} bytes")
    return (f"path too long: {shown}: {what}, but this file system allows {name_max} bytes per name and "
            f"{path_max} per path (specstop adds up to 30 characters to an output's name for its temporary "
            "files); give a shorter path")


class OutputNotWritableError(UserError):
    """An output location cannot be created or written (read-only, no permission, full disk)."""


def _probe(folder: Path) -> None:
    """Create, fill and remove a small file in ``folder`` (raises the OSError a real write would)."""
    fd, tmp = tempfile.mkstemp(prefix=".specstop-probe-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def check_writable(path: str | Path, flag: str, *, kind: str = "folder") -> Path:
    """Refuse, before any long work, an output that cannot be written.

    Nothing is created: the nearest existing folder on the way to ``path`` must be a folder and
    take a small probe file (which is removed again), so a read-only location, missing permission
    or a full disk is one line now instead of a traceback after the work.

    Args:
        path: the output folder (``kind="folder"``) or file (``kind="file"``).
        flag: how the user named it (``--out``, ``--data``, ``SPECSTOP_CACHE``), for the message.
        kind: ``folder`` or ``file``.

    Returns:
        ``path`` as a Path.

    Raises:
        OutputNotWritableError: naming the location and the problem.
    """
    p = Path(path).expanduser()
    if kind == "folder" and p.exists() and not p.is_dir():
        raise OutputNotWritableError(f"{flag} {p} is a file, not a folder; give a folder path")
    if kind == "file" and p.is_dir():
        raise OutputNotWritableError(f"{flag} {p} is a folder; give a file path (e.g. {p / 'out.json'})")
    probe_dir = p if kind == "folder" else p.parent
    existing = probe_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputNotWritableError(
            f"{flag} {p}: {existing} is a file, so no folder can be created there; choose another location"
        )
    try:
        _probe(existing)
    except OSError as err:
        msg = write_error_message(err, "checking that it can be written") if err.errno in WRITE_ERRNOS else None
        detail = msg or f"{err.strerror or err}"
        raise OutputNotWritableError(f"{flag} {p}: {detail}") from None
    return p


def open_new_file(folder: str | Path, prefix: str, mode: str = "w"):
    """Create a new, uniquely named file in ``folder`` and open it: ``(file object, path)``.

    The file gets the permissions a plain ``open()`` gives (``0666 & ~umask``), unlike
    ``tempfile.mkstemp``'s private 0600, which a rename would carry over to the finished file
    (manifests, tuned files, cost tables others must read).
    """
    folder = Path(folder)
    for _attempt in range(100):
        path = folder / f"{prefix}{uuid.uuid4().hex[:12]}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue
        try:
            return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})), path
        except BaseException:  # pragma: no cover
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
    raise FileExistsError(f"no free temporary name in {folder}")  # pragma: no cover


def default_file_mode(path: str | Path) -> Path:
    """Give ``path`` the mode a plain ``open()`` gives under the current umask (``0666 & ~umask``).

    safetensors' writer creates its files private (0600) whatever the umask; exports and converted
    models are files other people and processes read.
    """
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
    return Path(path)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``: a failed write (a
    full disk) leaves the old file or nothing, never half a file. The file's mode is what a plain
    ``open()`` would give under the current umask."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with naming_writes(path):
        f, tmp = open_new_file(path.parent, f".{path.name}.")
        try:
            with f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path
