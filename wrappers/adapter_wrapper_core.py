"""The per-lease wrapper: one per adapter, owning the adapter's whole process tree.

Started by ``adapter_wrapper.py`` beside it, the program acp-proxy runs:
``python -I -S adapter_wrapper.py --lifeline FD --report FD --grace S [--tombstone PATH]
[--hold FD,...] [--cgroup DIR] -- ARGV...``
(standard library only, so it starts fast and cannot be broken by site packages).
acp-proxy starts it with ``start_new_session=True``, the adapter's stdin/stdout as
its own, a lifeline pipe and a report pipe. The wrapper:

* marks itself a child subreaper (Linux), so every orphaned descendant of the
  adapter, even one that ``setsid``-ed and double-forked away, becomes its child;
* with ``--cgroup``, moves itself into that cgroup v2 (made for this tree by acp-proxy)
  before it forks, so that the adapter and everything it starts are members from their
  first instruction; a failure is reported (``cgroup_error``) and the adapter started anyway:
  acp-proxy decides whether that start stands. Once the tree is gone, if acp-proxy is gone
  too, it moves back to the cgroup it was started in and removes the tree's, and its
  instance's if that was the last tree; a living acp-proxy removes them itself (moving out of
  a cgroup that has had forks in it waits for the kernel, 6-28 ms: not on a close's path);
* forks the adapter into a process group of its own, hands it stdin/stdout and
  drops its own copies (the bytes never pass through here);
* reports ``{"adapter_pid", "pgid", "start_ticks", ...}`` on the report pipe;
* reaps with ``waitpid(-1)``, and tears the tree down when the adapter exits
  leaving descendants, on SIGTERM/SIGINT/SIGHUP, or when the lifeline reaches
  EOF (acp-proxy died, however it died). acp-proxy writes a byte on the lifeline when it
  begins to stop the tree: it will remove the tree's cgroup itself;
* keeps the ``--hold`` descriptors (the install's slot locks) open, and out of the
  adapter's reach, until it exits: a slot is free exactly when its tree is gone;
* once nothing is left, writes the tombstone file (proof for a later reaper that
  the tree ended under control) and exits with the adapter's status,
  re-raising the signal that killed it.

It never uses ``PR_SET_PDEATHSIG``: that fires when the *thread* that spawned the
process exits, and trio spawns processes from worker threads.

Teardown: SIGTERM + SIGCONT to the adapter's group and SIGTERM to every other
descendant; wait up to the grace; then, until no descendant is left, SIGSTOP
top-down (so nothing can fork or reap while it is being killed) and SIGKILL
deepest-first, and reap. The wrapper signals only its own descendants, found by
walking child links down from itself (``/proc/PID/task/TID/children``: the tree alone is read,
however many processes the host runs; where the kernel lacks that file, every process's parent
link is read instead).
"""

from __future__ import annotations

import errno
import os
import select
import sys
import time

TYPE_CHECKING = False  # ``typing`` would cost more than all the rest of our imports
if TYPE_CHECKING:
    import signal
    from collections.abc import Callable
else:
    try:
        import _signal as signal  # ``signal`` is this and its enums, whose creation is a third of our start
    except ImportError:  # not CPython
        import signal

PR_SET_CHILD_SUBREAPER = 36
POLL_INTERVAL = 0.02
LIFELINE_WAIT = 0.1
"""A tree that ended with nothing said on the lifeline: how long to wait for its EOF (a SIGKILLed
acp-proxy's descriptors close one at a time: the adapter's stdin may reach EOF first)."""
EMPTY_PATIENCE = 2.0
"""How long a cgroup whose processes have gone may stay busy before its removal is left to the reaper."""
FATAL_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def set_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = _libc_prctl()
    except Exception:  # ``_ctypes`` is not a public interface: fall back to ``ctypes``
        try:
            import ctypes

            prctl = ctypes.CDLL(None).prctl
        except (OSError, AttributeError):
            return False
    return int(prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0


def _libc_prctl() -> Callable[..., int]:
    """libc's ``prctl`` through ``_ctypes`` alone: ``import ctypes`` would double the cost of our start."""
    import _ctypes

    class Int(_ctypes._SimpleCData):  # type: ignore[type-arg]
        _type_ = "i"

    class Function(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL
        _restype_ = Int

    class Library:  # what a function pointer is looked up in: a handle from ``dlopen``
        _handle = _ctypes.dlopen(None, os.RTLD_NOW)  # type: ignore[arg-type]

    return Function(("prctl", Library))  # type: ignore[arg-type]


def read_stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, start_ticks) from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19])


def descendants(root: int) -> list[tuple[int, int]]:
    """Live descendants of ``root`` as (pid, depth), parents before children (zombies left out: they
    are gone but for their exit status, and have no children)."""
    children_of = _live_children if _has_children_files() else _every_live_parent_link()
    found: list[tuple[int, int]] = []
    frontier = [(root, 0)]
    while frontier:
        pid, depth = frontier.pop(0)
        for child in children_of(pid):
            found.append((child, depth + 1))
            frontier.append((child, depth + 1))
    return found


def _live(stat: tuple[str, int, int, int] | None) -> bool:
    return stat is not None and stat[0] not in ("Z", "X")


def _live_children(pid: int) -> list[int]:
    """``pid``'s live children, as each of its threads lists those it forked or was handed as a subreaper."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []  # gone meanwhile
    children: list[int] = []
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children", "rb") as fh:
                children.extend(map(int, fh.read().split()))
        except OSError:
            pass  # that thread (or the process) ended meanwhile
    return [child for child in children if _live(read_stat(child))]


_children_files: list[bool] = []


def _has_children_files() -> bool:
    """Whether the kernel lists a task's children (``CONFIG_PROC_CHILDREN``, on in every common build)."""
    if not _children_files:
        me = os.getpid()
        _children_files.append(os.path.exists(f"/proc/{me}/task/{me}/children"))
    return _children_files[0]


def _every_live_parent_link() -> Callable[[int], list[int]]:
    """Live children by pid from every process's parent link: one read of each process on the host."""
    try:
        names = os.listdir("/proc")
    except OSError:
        names = []
    children: dict[int, list[int]] = {}
    for name in names:
        if name.isdigit():
            stat = read_stat(int(name))
            if stat is not None and _live(stat):
                children.setdefault(stat[1], []).append(int(name))
    return lambda pid: children.get(pid, [])


def send(pid: int, sig: int, group: bool = False) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Wrapper:
    def __init__(self, lifeline: int, grace: float) -> None:
        self.lifeline = lifeline
        self.grace = grace
        self.adapter_pid = 0
        self.adapter_status: int | None = None
        self.stop_requested = False
        self.proxy_stopping = False
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in FATAL_SIGNALS:
            signal.signal(sig, self._request_stop)

    def _request_stop(self, signum: int, frame: object) -> None:
        self.stop_requested = True

    def reap(self) -> bool:
        """Reap every child that has exited; whether any child is left."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if pid == self.adapter_pid:
                self.adapter_status = status

    def wait_events(self, timeout: float | None) -> None:
        watched = [self.wake_r] + ([self.lifeline] if self.lifeline >= 0 else [])
        try:
            readable, _, _ = select.select(watched, [], [], timeout)
        except InterruptedError:
            return
        if self.wake_r in readable:
            try:
                os.read(self.wake_r, 512)
            except BlockingIOError:
                pass
        if self.lifeline in readable:
            if os.read(self.lifeline, 512):
                self.proxy_stopping = True  # acp-proxy is stopping the tree, and removes its cgroup
            else:
                os.close(self.lifeline)
                self.lifeline = -1
                self.stop_requested = True  # EOF: acp-proxy is gone

    def proxy_removes_cgroup(self) -> bool:
        """Whether acp-proxy will remove the tree's cgroup itself once we have exited: it said it is
        stopping the tree (a byte on the lifeline), or it lives on (no EOF within ``LIFELINE_WAIT``),
        and then stops the tree itself when it sees us exit. Not once the lifeline is at EOF."""
        if self.proxy_stopping:
            return True
        if self.lifeline < 0:
            return False
        try:
            readable, _, _ = select.select([self.lifeline], [], [], LIFELINE_WAIT)
        except InterruptedError:
            return True
        return not readable or bool(os.read(self.lifeline, 512))

    def run(self) -> int:
        while True:
            children_left = self.reap()
            if self.adapter_status is not None:
                # No child left means no descendant: one whose parent lives is a child's descendant,
                # and an orphan becomes our child (subreaper). Only then is /proc walked.
                if children_left and descendants(os.getpid()):
                    self.teardown()
                return self.adapter_status
            if self.stop_requested:
                self.teardown()
                return self.adapter_status if self.adapter_status is not None else 0
            self.wait_events(None)

    def teardown(self) -> None:
        me = os.getpid()
        send(self.adapter_pid, signal.SIGTERM, group=True)
        send(self.adapter_pid, signal.SIGCONT, group=True)
        for pid, _ in descendants(me):
            send(pid, signal.SIGTERM)
            send(pid, signal.SIGCONT)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline:
            self.reap()
            if not descendants(me):
                return
            self.wait_events(POLL_INTERVAL)
        while True:
            tree = descendants(me)
            if not tree:
                break
            for pid, _ in tree:
                send(pid, signal.SIGSTOP)
            for pid, _ in sorted(tree, key=lambda entry: -entry[1]):
                send(pid, signal.SIGKILL)
            time.sleep(POLL_INTERVAL)
            self.reap()
        self.reap()


def exit_like(status: int) -> None:
    """Leave with the adapter's status: its exit code, or death by the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.set_wakeup_fd(-1)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def move_to_cgroup(directory: str) -> None:
    fd = os.open(directory + "/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, str(os.getpid()).encode())
    finally:
        os.close(fd)


def join_cgroup(directory: str) -> str | None:
    """Move this process into the tree's cgroup ``directory``; the error text if that failed."""
    try:
        move_to_cgroup(directory)
    except OSError as exc:
        return f"cannot join cgroup {directory}: {exc.strerror}"
    return None


def leave_cgroup(directory: str) -> None:
    """Once the tree is gone, acp-proxy gone too: back to the cgroup acp-proxy started us in, and
    remove the tree's. Then the instance's cgroup too, if this was its last tree. Whatever is left
    is removed by whoever reaps the dead proxy.
    """
    instance = os.path.dirname(directory)
    try:
        move_to_cgroup(os.path.dirname(instance))
    except OSError:
        return
    if remove_when_empty(directory) and not _has_cgroups_under(instance):
        remove_when_empty(instance)  # another tree's wrapper, last to end, may remove it first


def remove_when_empty(directory: str) -> bool:
    """Remove a cgroup once the kernel has let the last of its processes go, which lags their exit (and
    this process's move out of it) by milliseconds, by more on a loaded machine: ``EBUSY`` meanwhile,
    tried again until ``EMPTY_PATIENCE``. Whether it is gone."""
    deadline = time.monotonic() + EMPTY_PATIENCE
    while True:
        try:
            os.rmdir(directory)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                return False
        time.sleep(POLL_INTERVAL)


def _has_cgroups_under(directory: str) -> bool:
    try:
        with os.scandir(directory) as entries:
            return any(entry.is_dir(follow_symlinks=False) for entry in entries)
    except OSError:
        return False


def spawn_adapter(argv: list[str], keep_closed: list[int]) -> tuple[int, str | None]:
    """Fork and exec the adapter in its own process group; the error text if exec failed."""
    err_r, err_w = os.pipe()  # close-on-exec: EOF without data means exec succeeded
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            # Python ignores these at start-up; exec keeps an ignored disposition, so undo
            # it, or the adapter (and `yes | head` in its tools) would not behave as launched directly.
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
            for fd in keep_closed:
                os.close(fd)
            os.execvp(argv[0], argv)
        except OSError as exc:
            os.write(err_w, f"cannot run {argv[0]!r}: {exc.strerror}".encode())
        os._exit(127)
    os.close(err_w)
    try:
        os.setpgid(pid, pid)  # also from this side, so the group exists before we report it
    except OSError:
        pass  # the child got there first (or has already exec'd)
    error = os.read(err_r, 4096).decode(errors="replace") or None
    os.close(err_r)
    return pid, error


def write_tombstone(path: str, status: int) -> None:
    """Leave proof that this tree ended under control: written only once no descendant is left."""
    if not path:
        return
    try:
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # private, whatever the umask
        with open(fd, "w") as fh:
            fh.write(f'{{"status": {status}, "at": {time.time():.3f}}}')
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def report_line(
    adapter_pid: int, start_ticks: int | None, subreaper: bool, error: str | None, cgroup_error: str | None = None
) -> bytes:
    """The report as one JSON line, written by hand: importing json costs the adapter start-up time."""

    def quote(text: str) -> str:
        # JSON needs only '"', '\\' and control characters escaped. A lone surrogate (an
        # undecodable byte in a path) cannot be encoded at all: it becomes U+FFFD.
        out = []
        for c in text:
            code = ord(c)
            if c in '"\\' or code < 0x20:
                out.append(f"\\u{code:04x}")
            elif 0xD800 <= code <= 0xDFFF:
                out.append("\ufffd")
            else:
                out.append(c)
        return '"' + "".join(out) + '"'

    fields = [
        f'"adapter_pid": {adapter_pid}',
        f'"pgid": {adapter_pid}',
        f'"start_ticks": {"null" if start_ticks is None else start_ticks}',
        f'"subreaper": {"true" if subreaper else "false"}',
        f'"error": {"null" if error is None else quote(error)}',
        f'"cgroup_error": {"null" if cgroup_error is None else quote(cgroup_error)}',
    ]
    return ("{" + ", ".join(fields) + "}\n").encode()


def parse(args: list[str]) -> tuple[dict[str, str], list[str]]:
    cut = args.index("--")
    return dict(zip(args[:cut:2], args[1:cut:2], strict=True)), args[cut + 1 :]


def main() -> None:
    options, argv = parse(sys.argv[1:])
    lifeline, report, grace = int(options["--lifeline"]), int(options["--report"]), float(options["--grace"])
    subreaper = set_subreaper()
    wrapper = Wrapper(lifeline, grace)  # handlers first: a SIGTERM must never find us defenceless
    # --hold: the install's slot locks. Kept open until we exit (the tree is gone then), never
    # passed to the adapter: the slot must be free once this tree has ended, whatever it left.
    held = [int(fd) for fd in options.get("--hold", "").split(",") if fd]
    cgroup = options.get("--cgroup")
    cgroup_error = join_cgroup(cgroup) if cgroup else None
    adapter_pid, error = spawn_adapter(argv, [lifeline, report, *held])
    wrapper.adapter_pid = adapter_pid
    stat = read_stat(adapter_pid)
    try:
        os.write(report, report_line(adapter_pid, stat[3] if stat else None, subreaper, error, cgroup_error))
    except OSError:
        wrapper.stop_requested = True  # nobody to report to: acp-proxy died; tear down now
    os.close(report)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # the adapter holds stdin/stdout now; our copies would delay EOF
    os.dup2(devnull, 1)
    os.close(devnull)
    try:
        status = wrapper.run()
    except BaseException:
        wrapper.teardown()  # whatever went wrong here, the tree must not outlive us
        raise
    if cgroup and cgroup_error is None and not wrapper.proxy_removes_cgroup():
        leave_cgroup(cgroup)  # acp-proxy is gone: nobody else would, until the next reaping
    write_tombstone(options.get("--tombstone", ""), os.waitstatus_to_exitcode(status))
    exit_like(status)


if __name__ == "__main__":
    main()
