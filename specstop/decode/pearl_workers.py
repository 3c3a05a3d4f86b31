"""The two PEARL workers, each hosting one :class:`~specstop.decode.pearl_server.ModelServer`.

CPU (``processes``): one spawned process per model, pinned with ``os.sched_setaffinity`` to its own
cores and running ``torch.set_num_threads(len(cores))``, so the two forwards really run at the same
time without sharing an intra-op pool. Requests and token ids travel through a pipe; probability
rows (sampling) through a shared-memory buffer per worker, so a 150k-token vocabulary is not pickled
each phase. Each model reaches its worker as a ``torch.save`` file loaded with ``mmap=True``: the
worker's weights are the file's pages, not a copy. On Linux every such file is a ``memfd``
(:func:`_memfd`): anonymous shared memory that no folder names, handed to the worker as an inherited
descriptor (model files) or over the pipe (row buffers). It lives only while a process holds it, so
nothing is left behind whenever and however the parent dies (SIGKILL during start-up included), and
the size of ``/dev/shm`` does not matter. Elsewhere the files go to a private temporary folder
(under ``/dev/shm`` where it exists and has room, else the temporary folder: :func:`_shared_base`) and
are deleted as soon as the workers have mapped them (a SIGKILL while they start leaves its folder,
named by pid and pid namespace, which the next run's start removes: :func:`sweep_leftovers`; a folder
too small for both models is refused in one line first: :func:`check_shm_space`);
:meth:`PearlWorkers.close` (also on errors, Ctrl-C and SIGTERM) ends the workers and removes the folder. Workers ignore SIGINT - a Ctrl-C reaches the whole
process group, and the parent, not each child, decides how to shut down - and exit on their own when
the parent's end of the pipe closes or the parent dies (a watchdog thread in each worker notices the
parent pid change even while a forward runs). While workers run, a SIGTERM to the parent (where
nothing else handles it) raises ``SystemExit(143)`` in the parent's main thread, so it unwinds through
the same cleanup as Ctrl-C instead of dying with the workers and ``/dev/shm`` files left behind; the
previous handler is restored when the last pool closes.

CUDA (``threads``): one thread per model, each issuing its work on its own CUDA stream; the draft
goes to a second GPU when there is one (moved back on close).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch

from specstop.decode.busy_trace import BusyTrace, busy_overlap
from specstop.decode.pearl_server import ModelServer
from specstop.errors import UserError

__all__ = ["PearlWorkers", "WorkerError", "check_room_for", "check_shm_space", "sweep_leftovers"]

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a model file and importing torch/transformers in a fresh process
_POLL_S = 0.5


class WorkerError(RuntimeError):
    """A PEARL worker failed (its exception, named) or died; both workers have been shut down."""


# ---------------------------------------------------------------------------------- SIGTERM in the parent
_term_lock = threading.Lock()
_term = {"pools": 0, "previous": None, "defer": 0, "pending": False}


def _on_sigterm(signum, frame) -> None:
    """Turn SIGTERM into ``SystemExit(128 + signum)``: every ``except BaseException`` / ``finally`` on
    the way out (the decoder's, the CLI's) closes the workers, then the process exits with the status
    a shell reports for SIGTERM. A SIGTERM during that cleanup (or while a worker is being spawned) is
    held until it is done (:func:`_sigterm_deferred`)."""
    if _term["defer"]:
        _term["pending"] = True
        return
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _sigterm_deferred(raise_held: bool = True) -> Iterator[None]:
    """Hold a SIGTERM that arrives inside the block until it ends.

    Cut short, a spawn leaves its child reading a half-written pipe (it dies printing a traceback), a
    folder or worker not yet recorded escapes the cleanup, and a cleanup stops half way.

    Args:
        raise_held: raise the held SIGTERM's ``SystemExit`` when the block ends normally (not at
            interpreter exit, where it would skip the remaining finalizers).
    """
    in_main = threading.current_thread() is threading.main_thread()  # handlers run in the main thread
    _term["defer"] += in_main
    try:
        yield
    finally:
        _term["defer"] -= in_main
    if raise_held:
        _raise_held_sigterm()


def _raise_held_sigterm() -> None:
    """Exit now for a SIGTERM held during a deferred block (main thread, no such block still running)."""
    if _term["pending"] and not _term["defer"] and threading.current_thread() is threading.main_thread():
        _term["pending"] = False
        raise SystemExit(128 + signal.SIGTERM)


def _hold_sigterm() -> bool:
    """Install :func:`_on_sigterm` for one more pool; returns whether this pool holds it (only the main
    thread can set handlers, and a handler someone else installed is left alone)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    with _term_lock:
        current = signal.getsignal(signal.SIGTERM)
        if _term["pools"] == 0 and current is not _on_sigterm:  # (still ours when a thread released it last)
            if current is not signal.SIG_DFL:
                return False
            _term["previous"] = signal.signal(signal.SIGTERM, _on_sigterm)
        _term["pools"] += 1
    return True


def _release_sigterm() -> None:
    """One pool fewer; the last restores the handler that was there before."""
    with _term_lock:
        _term["pools"] -= 1
        if _term["pools"] > 0:
            return
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, _term["previous"])


# ---------------------------------------------------------------------------------- child process
def _exit_with_parent(parent_pid: int) -> None:
    """Watchdog thread of a worker: end the process as soon as the parent is gone (killed with SIGKILL,
    say), even in the middle of a forward, instead of lingering until the pipe is next read."""
    while os.getppid() == parent_pid:
        time.sleep(_POLL_S)
    os._exit(1)


def _register_output_capture(model) -> None:
    """Record, for an unpickled transformers model, which outputs its hooks can capture.

    ``PreTrainedModel.__init__`` registers that per class; a model loaded with ``torch.load`` in a fresh
    process skipped it, and its ``output_hidden_states`` forwards (hidden-state stopping policies)
    would return None.
    """
    try:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # a transformers without the registry captures outputs without it
        return
    for module in model.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        # The registry's key is the module on newer transformers 5 releases, its class name on older ones.
        for key in (module, str(module.__class__)):
            if not _CAN_RECORD_REGISTRY.get(key):
                _CAN_RECORD_REGISTRY[key] = getattr(module, "_can_record_outputs", None)


def _send(conn, msg) -> bool:
    """Send ``msg`` to the parent; False when the parent's end is closed (it exited or was killed)."""
    try:
        conn.send(msg)
        return True
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return False


def _child_main(conn, model_path: str, route: str, cores: list[int], vocab_size: int, eos: list[int],
                parent_pid: int) -> None:
    """Entry point of a worker process: pin, load, then serve requests until told to close (or the parent
    is gone: its pipe closed, or the watchdog saw its pid change)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and closes us
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()
    rows: torch.Tensor | None = None
    try:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
        model = torch.load(model_path, mmap=True, weights_only=False)
        model.eval()
        _register_output_capture(model)
        if route != "linear":
            from specstop.pair.fast_paths import apply_route

            apply_route(model, route)
        server = ModelServer(model, vocab_size, set(eos))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises it
        _send(conn, ("error", f"{type(err).__name__}: {err}", traceback.format_exc()))
        return
    if not _send(conn, ("ready", {"pid": os.getpid(), "cores": cores, "threads": torch.get_num_threads()})):
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        op, args = msg[0], msg[1:]
        if op == "close":
            # Nothing to flush or remove (the files were unlinked once mapped): skip the interpreter's
            # teardown of torch, which takes about a second, so shutdown (Ctrl-C, SIGTERM) is prompt.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        try:
            if op == "map_rows":
                path, n_rows, width = args
                fd = None
                if path is None:  # a memfd follows on the pipe
                    from multiprocessing import reduction

                    fd = reduction.recv_handle(conn)
                    path = _fd_path(fd)
                rows = torch.from_file(path, shared=True, size=n_rows * width, dtype=torch.float32).view(n_rows, width)
                if fd is not None:
                    os.close(fd)  # the mapping keeps the memory
                reply = ("ok", None)
            else:
                out = getattr(server, op)(*args)
                if isinstance(out, tuple) and len(out) == 3 and (out[1] is None or isinstance(out[1], torch.Tensor)):
                    ids, probs, seconds = out
                    k = 0
                    if probs is not None:
                        if rows is None or probs.shape[0] > rows.shape[0] or probs.shape[1] != rows.shape[1]:
                            raise RuntimeError(f"no shared row buffer for {tuple(probs.shape)} rows")
                        k = probs.shape[0]
                        rows[:k].copy_(probs)
                    out = (ids, k, seconds)
                reply = ("ok", out)
        except BaseException as err:  # noqa: BLE001 - reported, then the worker exits
            _send(conn, ("error", f"{type(err).__name__}: {err}", traceback.format_exc()))
            return
        if not _send(conn, reply):
            return


# ---------------------------------------------------------------------------------- parent side
class _ProcessWorker:
    """The parent's handle on one worker process."""

    def __init__(self, name: str, ctx, model_path: Path | _InheritedFd, route: str, cores: list[int],
                 vocab_size: int, eos: set[int]) -> None:
        self.name = name
        self.cores = cores
        self.conn, child = ctx.Pipe(duplex=True)
        model_arg = model_path if isinstance(model_path, _InheritedFd) else str(model_path)
        self.proc = ctx.Process(
            target=_child_main, args=(child, model_arg, route, cores, vocab_size, sorted(eos), os.getpid()),
            name=f"specstop-pearl-{name}", daemon=True,
        )
        self.proc.start()
        child.close()  # our copy: the child's end must close when the child exits (EOF detection)
        self.rows: torch.Tensor | None = None
        self.info: dict = {}
        self._close_sent = False

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        self.info = self._recv(timeout)

    def submit(self, op: str, *args) -> None:
        try:
            self.conn.send((op, *args))
        except (BrokenPipeError, OSError) as err:
            raise WorkerError(f"{self.name} worker is gone ({self._exit_text()})") from err

    def result(self):
        out = self._recv(None)
        if isinstance(out, tuple) and len(out) == 3 and isinstance(out[1], int):
            ids, k, seconds = out
            return ids, (self.rows[:k].clone() if k else None), seconds
        return out

    def map_rows(self, path: Path | int, rows: torch.Tensor) -> None:
        """Have the worker map the row buffer ``rows`` ([n_rows, vocab]): a file ``path``, or a memfd."""
        if isinstance(path, int):
            from multiprocessing import reduction

            self.submit("map_rows", None, rows.shape[0], rows.shape[1])
            try:
                reduction.send_handle(self.conn, path, self.proc.pid)
            except OSError as err:
                raise WorkerError(f"{self.name} worker is gone ({self._exit_text()})") from err
        else:
            self.submit("map_rows", str(path), rows.shape[0], rows.shape[1])
        self._recv(None)
        self.rows = rows

    def _recv(self, timeout: float | None):
        waited = 0.0
        while not self.conn.poll(_POLL_S):
            waited += _POLL_S
            if not self.proc.is_alive():
                raise WorkerError(f"{self.name} worker died ({self._exit_text()})")
            if timeout is not None and waited >= timeout:
                raise WorkerError(f"{self.name} worker did not answer within {timeout:.0f} s")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError) as err:
            raise WorkerError(f"{self.name} worker died ({self._exit_text()})") from err
        if msg[0] == "error":
            raise WorkerError(f"{self.name} worker failed: {msg[1]}\n{msg[2]}")
        return msg[1]

    def _exit_text(self) -> str:
        self.proc.join(0.1)
        code = self.proc.exitcode
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def request_close(self) -> None:
        """Ask the worker to exit (once) without waiting, so several workers wind down together."""
        if not self._close_sent and self.proc.is_alive():
            self._close_sent = True
            try:
                self.conn.send(("close",))
            except (BrokenPipeError, OSError):
                pass

    def close(self) -> None:
        self.request_close()
        if self.proc.is_alive():
            self.proc.join(5.0)  # a forward in flight finishes first
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


class _ThreadWorker:
    """One model served from a thread (CUDA: on its own stream)."""

    def __init__(self, name: str, model, vocab_size: int, eos: set[int], origin=None) -> None:
        self.name = name
        self.server = ModelServer(model, vocab_size, eos)
        dev = self.server.device
        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self.busy = BusyTrace(self.stream, origin if self.stream is not None else None)
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=f"specstop-pearl-{name}", daemon=True)
        self.thread.start()
        self.info = {"thread": self.thread.name, "device": str(dev)}

    def _loop(self) -> None:
        while True:
            msg = self.inbox.get()
            if msg is None:
                return
            op, args = msg
            try:
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        self.busy.begin()
                        out = getattr(self.server, op)(*args)
                        self.busy.end()
                else:
                    self.busy.begin()
                    out = getattr(self.server, op)(*args)
                    self.busy.end()
                self.outbox.put(("ok", out))
            except BaseException as err:  # noqa: BLE001 - handed to the coordinator
                self.outbox.put(("error", err))

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        return None

    def submit(self, op: str, *args) -> None:
        if not self.thread.is_alive():
            raise WorkerError(f"{self.name} worker thread is gone")
        self.inbox.put((op, args))

    def result(self):
        while True:
            try:
                status, out = self.outbox.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self.thread.is_alive():
                    raise WorkerError(f"{self.name} worker thread is gone") from None
        if status == "error":
            raise WorkerError(f"{self.name} worker failed: {type(out).__name__}: {out}") from out
        if isinstance(out, tuple) and len(out) == 3 and isinstance(out[1], torch.Tensor):
            return out[0], out[1].float().cpu(), out[2]
        return out

    def close(self) -> None:
        self.inbox.put(None)
        self.thread.join()


# ---------------------------------------------------------------------------------- the pair
_FD_DIR = "/proc/self/fd/"


def _memfd(name: str) -> int | None:
    """A Linux memfd: shared memory with no name in any folder, or None where there is none.

    Its pages live only while a process holds its descriptor or a mapping of it, so unlike a file
    in ``/dev/shm`` it cannot outlive a SIGKILL, and the size of ``/dev/shm`` does not limit it.
    Its path for ``open``, ``torch.save`` and ``torch.load(mmap=True)`` is :func:`_fd_path`.
    """
    create = getattr(os, "memfd_create", None)
    if create is None or not os.path.isdir(_FD_DIR):
        return None
    try:
        return create(f"specstop-pearl-{name}", os.MFD_CLOEXEC)
    except OSError:  # a kernel or sandbox without memfd: the folder path below
        return None


def _fd_path(fd: int) -> str:
    """The path that opens this process's descriptor ``fd`` again (the same memory)."""
    return f"{_FD_DIR}{fd}"


class _InheritedFd:
    """A memfd for a spawned worker: pickled as a descriptor the worker inherits, unpickled there as its
    :func:`_fd_path` (the path ``torch.load`` maps)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _inherited_path, (reduction.DupFd(self.fd),)


def _inherited_path(dup) -> str:
    return _fd_path(dup.detach())


def _close_fds(fds: list[int]) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())


SHM_DIR = "/dev/shm"
_SESSION_PREFIX = "specstop-pearl-"
_SESSION_NAME = re.compile(rf"{_SESSION_PREFIX}(\d+)-(\d+)-[A-Za-z0-9_]+")
_MB = 1 << 20
SHM_MARGIN_BYTES = 16 * _MB  # plus 2%: pickle framing, the row buffers, whatever shares the folder meanwhile


def _pid_namespace() -> int:
    """This process's pid namespace (a pid means something only inside its own); 0 where unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _owner_running(pid: int, since: float) -> bool:
    """Is ``pid`` the live process that made a folder last changed at ``since`` (not a reused pid)?"""
    try:
        import psutil

        return psutil.Process(pid).create_time() <= since + 1.0
    except Exception:  # noqa: BLE001 - no such process (or no psutil: only this check is lost)
        return False


def sweep_leftovers(base: str | Path) -> list[str]:
    """Remove the session folders of PEARL runs whose process is gone.

    The model files live only until the workers map them; a run killed with SIGKILL while they
    start (nothing in the process can clean up then) leaves them in ``base`` - on ``/dev/shm``,
    memory - for good. Each folder is named ``specstop-pearl-<pid>-<pid namespace>-<random>``: one
    of this pid namespace and user whose pid no longer runs (or runs a younger process: a reused
    pid) is removed. Another namespace's or user's folders are left alone.

    Returns:
        The names of the folders removed.
    """
    removed = []
    ns, uid = _pid_namespace(), os.getuid()
    try:
        entries = list(Path(base).glob(f"{_SESSION_PREFIX}*"))
    except OSError:
        return removed
    for folder in entries:
        m = _SESSION_NAME.fullmatch(folder.name)
        if m is None or int(m.group(2)) != ns:
            continue
        try:
            st = folder.stat()
        except OSError:
            continue
        if st.st_uid != uid or not folder.is_dir() or _owner_running(int(m.group(1)), st.st_mtime):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder.name)
    if removed:
        log.info("removed %d PEARL folder(s) of runs that were killed: %s", len(removed), ", ".join(removed))
    return removed


def check_shm_space(base: str | Path, need_bytes: int) -> None:
    """Refuse to share ``need_bytes`` through ``base`` when it has less room than that (a container's
    ``/dev/shm`` is 64 MB by default; torch would fail half way with a bus error or a raw error).

    Raises:
        UserError: naming what PEARL needs, what is free and the fixes.
    """
    try:
        free = shutil.disk_usage(base).free
    except OSError:
        return
    need = need_bytes + need_bytes // 50 + SHM_MARGIN_BYTES
    if need <= free:
        return
    size = -(-need // (256 * _MB)) * 256  # rounded up to 256 MB
    raise UserError(
        f"PEARL shares both models' weights with its worker processes through {base}: it needs about "
        f"{-(-need // _MB)} MB there but {base} has {free // _MB} MB free; give it more room (a container: "
        f"docker run --shm-size={size}m ...), or skip PEARL's worker processes: calibrate-cost --no-pearl-split "
        "(a pipeline: calibrate: {no_pearl_split: true}), or decode with a chain or tree --policy instead of pearl"
    )


def _weights_bytes(*models) -> int:
    """Bytes of the models' parameters and buffers (what their ``torch.save`` files hold)."""
    total = 0
    for model in models:
        for t in (*model.parameters(), *model.buffers()):
            total += t.numel() * t.element_size()
    return total


def _shared_base(need_bytes: int = 0) -> str:
    """Where PEARL's session folders go (systems without memfd): ``/dev/shm`` where it exists and has
    room for ``need_bytes``, else the temporary folder (said in one line: disk-backed, so the first
    forwards may read from disk)."""
    if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)):
        return tempfile.gettempdir()
    try:
        check_shm_space(SHM_DIR, need_bytes)
    except UserError:
        tmp = tempfile.gettempdir()
        log.warning("%s has no room for PEARL's %d MB of weights: they go through %s instead",
                    SHM_DIR, -(-need_bytes // _MB), tmp)
        return tmp
    return SHM_DIR


def check_room_for(pair) -> None:
    """Refuse now (before minutes of other work) when the pair's weights would not fit where PEARL's
    worker processes share them: nowhere to check with memfd, else :func:`check_shm_space` of the
    folder :func:`_shared_base` chooses."""
    probe = _memfd("probe")
    if probe is not None:
        os.close(probe)
        return
    need = _weights_bytes(pair.draft, pair.target)
    check_shm_space(_shared_base(need), need)


def _session_dir(need_bytes: int = 0) -> Path:
    """A private folder for model files and row buffers (tmpfs where there is one), after sweeping
    the leftovers of killed runs and checking that ``need_bytes`` fit."""
    base = _shared_base(need_bytes)
    sweep_leftovers(base)
    check_shm_space(base, need_bytes)
    return Path(tempfile.mkdtemp(prefix=f"{_SESSION_PREFIX}{os.getpid()}-{_pid_namespace()}-", dir=base))


_CAPTURE_HOOKS = "transformers.utils.output_capturing"  # where transformers defines its capture hooks
_CAPTURE_FLAG = "_output_capturing_hooks_installed"


def _without_capture_hooks(model) -> list:
    """Detach the forward hooks transformers installs on a model's first ``output_hidden_states`` forward
    (local closures, which pickle cannot save) and its "installed" marks; returns what
    :func:`_restore_capture_hooks` puts back. The worker's copy installs its own on first use."""
    saved = []
    for module in model.modules():
        hooks = module._forward_hooks
        ours = [k for k, fn in hooks.items() if getattr(fn, "__module__", None) == _CAPTURE_HOOKS]
        flag = module.__dict__.pop(_CAPTURE_FLAG, None)
        if ours or flag is not None:
            saved.append((module, hooks.copy(), flag))
            for k in ours:
                del hooks[k]
    return saved


def _restore_capture_hooks(saved: list) -> None:
    for module, hooks, flag in saved:
        module._forward_hooks.clear()
        module._forward_hooks.update(hooks)  # the original order
        if flag is not None:
            module.__dict__[_CAPTURE_FLAG] = flag


def _save_portable(model, path: Path) -> str:
    """``torch.save`` the whole module; returns the linear route it was on (:mod:`specstop.pair.fast_paths`).

    A route binds methods (and, packed, oneDNN tensors) to instances, which pickle cannot restore: it
    is switched off for the save, back on right after, and re-applied by the worker. Output-capturing
    hooks (a model that has already returned hidden states) are detached for the save the same way.
    """
    from specstop.pair.fast_paths import apply_route, route_of

    route = route_of(model)
    if route != "linear":
        apply_route(model, "linear")
    hooks = _without_capture_hooks(model)
    try:
        torch.save(model, path)
    finally:
        _restore_capture_hooks(hooks)
        if route != "linear":
            apply_route(model, route)
    return route


def _shutdown(workers: list, folder: list[Path | None], term: list[bool], fds: list[int] | None = None) -> None:
    """Close every worker, remove the session folder and give back the SIGTERM handler (idempotent;
    also runs at exit). A SIGTERM meanwhile is held; :meth:`PearlWorkers.close` raises it after."""
    with _sigterm_deferred(raise_held=False):
        for w in workers:
            getattr(w, "request_close", lambda: None)()
        while workers:
            w = workers.pop()
            try:
                w.close()
            except Exception:  # noqa: BLE001 - keep closing the others
                pass
        if folder[0] is not None:
            shutil.rmtree(folder[0], ignore_errors=True)
            folder[0] = None
        _close_fds(fds if fds is not None else [])
        if term[0]:
            term[0] = False
            _release_sigterm()


class PearlWorkers:
    """The draft and target workers of a PEARL decoder (a context manager).

    Args:
        pair: the :class:`~specstop.pair.ModelPair`.
        cores: ``(draft cores, target cores)`` for the ``processes`` backend
            (:func:`~specstop.decode.pearl_spec.split_cores`).
        backend: ``processes`` (CPU: pinned processes), ``threads`` (CUDA streams; on CPU the two
            threads share one intra-op pool) or ``auto`` (threads on CUDA, processes on CPU).
    """

    def __init__(self, pair, cores: tuple[list[int], list[int]] | None = None, backend: str = "auto") -> None:
        from specstop.decode.chain import eos_token_ids

        if backend not in ("auto", "processes", "threads"):
            raise ValueError(f"backend must be auto, processes or threads, got {backend!r}")
        on_cuda = pair.target_device.type == "cuda" or pair.draft_device.type == "cuda"
        self.backend = ("threads" if on_cuda else "processes") if backend == "auto" else backend
        self.pair = pair
        self.cores = cores
        self.vocab_size = pair.vocab_size
        self.eos = eos_token_ids(pair)
        self.draft = self.target = None
        self._workers: list = []
        self._folder: list[Path | None] = [None]
        self._fds: list[int] = []  # memfds this process still holds (model files, row buffers)
        self._term = [False]  # whether this pool holds the SIGTERM handler
        self._moved_draft: torch.device | None = None
        self._rows = 0
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._folder, self._term, self._fds)

    @property
    def started(self) -> bool:
        return self.draft is not None

    def start(self) -> PearlWorkers:
        """Start both workers (both processes load at the same time); idempotent."""
        if self.started:
            return self
        if self.backend == "processes" and not self._term[0]:
            # Before the first file is written: a SIGTERM while the models are saved or loaded cleans up too.
            self._term[0] = _hold_sigterm()
        try:
            if self.backend == "processes":
                self._start_processes()
            else:
                self._start_threads()
        except BaseException:
            self.close()
            raise
        return self

    def _start_processes(self) -> None:
        if self.cores is None:
            from specstop.decode.pearl_spec import split_cores

            self.cores = split_cores(None)
        ctx = torch.multiprocessing.get_context("spawn")
        folder = None
        started = []
        for name, model, cores in (("draft", self.pair.draft, self.cores[0]), ("target", self.pair.target, self.cores[1])):
            with _sigterm_deferred():  # the descriptor (or folder) is recorded before anything can interrupt
                fd = _memfd(name)
                if fd is not None:
                    self._fds.append(fd)
                elif folder is None:
                    need = _weights_bytes(self.pair.draft, self.pair.target)
                    folder = self._folder[0] = _session_dir(need)
            path = Path(_fd_path(fd)) if fd is not None else folder / f"{name}.pt"
            route = _save_portable(model, path)
            with _sigterm_deferred():  # a whole spawn, and the worker recorded for the cleanup
                w = _ProcessWorker(name, ctx, _InheritedFd(fd) if fd is not None else path, route, list(cores),
                                   self.vocab_size, self.eos)
                self._workers.append(w)
            started.append(w)
        for w in started:
            w.wait_ready()
        self._forget_folder()  # the workers hold their weights mapped: the files can go
        self.draft, self.target = started

    def _start_threads(self) -> None:
        draft_model = self.pair.draft
        dev = self.pair.draft_device
        if dev.type == "cuda" and torch.cuda.device_count() > 1 and dev == self.pair.target_device:
            other = torch.device("cuda", (dev.index or 0) + 1 if (dev.index or 0) + 1 < torch.cuda.device_count() else 0)
            draft_model.to(other)  # draft and target on separate GPUs; moved back in close()
            self._moved_draft = dev
        origin = None
        if self.pair.target_device.type == "cuda":  # one time axis for both streams' busy intervals
            origin = torch.cuda.Event(enable_timing=True)
            origin.record(torch.cuda.current_stream(self.pair.target_device))
        self.draft = _ThreadWorker("draft", draft_model, self.vocab_size, self.eos, origin)
        self._workers.append(self.draft)
        self.target = _ThreadWorker("target", self.pair.target, self.vocab_size, self.eos, origin)
        self._workers.append(self.target)

    def busy(self, clear: bool = False) -> dict[str, float]:
        """Seconds the draft worker was busy, the target worker, and both at once (threads backend; on
        CUDA measured by events on the two streams). ``both_s`` > 0 shows the two really overlapped.

        Args:
            clear: forget the intervals read, so the next call measures only what runs after it.
        """
        if self.backend != "threads" or self.draft is None:
            raise RuntimeError("busy intervals are traced by the started threads backend only")
        got = busy_overlap(self.draft.busy.intervals(), self.target.busy.intervals())
        if clear:
            self.draft.busy.clear()
            self.target.busy.clear()
        return {"draft_s": got["first_s"], "target_s": got["second_s"], "both_s": got["both_s"]}

    def ensure_rows(self, n_rows: int) -> None:
        """Give both workers shared buffers for ``n_rows`` probability rows (sampling)."""
        if self.backend != "processes" or n_rows <= self._rows:
            return
        size = n_rows * self.vocab_size
        try:
            for w in (self.draft, self.target):
                with _sigterm_deferred():  # the descriptor (or folder) is recorded before anything can interrupt
                    fd = _memfd(f"{w.name}-rows")
                    if fd is not None:
                        self._fds.append(fd)
                    else:
                        folder = self._folder[0] = self._folder[0] or _session_dir(2 * size * 4)
                path = _fd_path(fd) if fd is not None else str(folder / f"{w.name}.rows")
                if fd is not None:
                    os.ftruncate(fd, size * 4)  # from_file maps what is there; a memfd starts empty
                buf = torch.from_file(path, shared=True, size=size, dtype=torch.float32)
                w.map_rows(fd if fd is not None else Path(path), buf.view(n_rows, self.vocab_size))
        finally:
            self._forget_folder()
        self._rows = n_rows

    def _forget_folder(self) -> None:
        """Drop this process's hold on the files the workers have mapped (their mappings keep them)."""
        _close_fds(self._fds)
        if self._folder[0] is not None:
            shutil.rmtree(self._folder[0], ignore_errors=True)
            self._folder[0] = None

    def describe(self) -> dict:
        """Where each model runs (pids and cores, or threads and devices)."""
        out = {"backend": self.backend}
        for w in (self.draft, self.target):
            if w is not None:
                out[w.name] = dict(w.info)
        return out

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if isinstance(w, _ProcessWorker)]

    def close(self) -> None:
        """End both workers and remove every file this pool wrote (safe to call twice)."""
        _shutdown(self._workers, self._folder, self._term, self._fds)
        self.draft = self.target = None
        self._rows = 0
        if self._moved_draft is not None:
            self.pair.draft.to(self._moved_draft)
            self._moved_draft = None
        _raise_held_sigterm()

    def __enter__(self) -> PearlWorkers:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
