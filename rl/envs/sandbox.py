"""A sandboxed Python interpreter: run model-written code in a fresh process and a fresh
temp dir, with limits, and always get an observation back.

    result = run_python("print(sum(range(10)))")
    result.observation()        # '45' (or the error, or 'killed: over 5 s of CPU time')

Limits (`SandboxLimits`): CPU seconds (RLIMIT_CPU), wall seconds (the process group is
killed), address space (RLIMIT_AS, MB), processes (RLIMIT_NPROC, counted for the uid the
code runs as), output bytes (stdout + stderr; past it the process is killed), file size
(RLIMIT_FSIZE, MB), no core files. stdin is /dev/null. The rlimits are set by the sandboxed
interpreter on itself before the code runs (not in a preexec_fn: the caller is
multithreaded, with JAX and the tool pool, and Python between fork and exec could
deadlock); the code cannot raise them (it runs as nobody under bubblewrap; the fallback's
hook refuses setrlimit).

Isolation, strongest available (`isolation()` says which this machine has):

  * "bubblewrap" (the OS package `bubblewrap`; the project's setup and .ci/run install it):
    new network, pid, ipc and uts namespaces (no network but a loopback that is down; the
    code sees only its own processes and dies with its parent), a filesystem of the
    interpreter's files read-only (the Python prefix at /python, /usr), a private
    /tmp, and the temp dir as the only writable place (/sandbox, the working dir); no /etc,
    no home, no run dir. Run as root, the code drops to uid/gid 65534 (nobody) before it
    starts, so RLIMIT_NPROC applies and it owns nothing outside.
  * "rlimits" (the documented, weaker fallback, with a one-line warning): the same rlimits,
    a fresh temp dir as working dir (the code keeps the caller's uid: RLIMIT_NPROC binds
    no root process), and a Python audit hook
    (sys.addaudithook, installed before the code runs and not removable from Python) that
    refuses sockets, new processes (fork, exec, spawn, subprocess), signals to other
    processes, ctypes / cffi, and opening files outside the temp dir (reading is allowed
    under the Python prefix and /usr, so imports work). It stops Python code, not a
    determined native-code escape, and the network is not namespaced.

Inside bubblewrap the kernel's namespaces and limits are the boundary (no audit hook): the
code may fork (within RLIMIT_NPROC), use ctypes, or crash in C (reported as the signal
that killed it).

Whatever the code does, `run_python` returns a SandboxResult: stdout, stderr, exit code,
and `killed` ("over N s of CPU time", "over N s wall time", "over N bytes of output",
"signal SIGSEGV", ...) when the process did not end by itself; `observation()` makes the
text an environment shows the model. The temp dir is removed afterwards.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from typing import Any

NOBODY = 65534
ISOLATIONS = ("bubblewrap", "rlimits")

# Runs first in the sandboxed interpreter: limits that need the code's own process, the
# uid drop, the audit hook (fallback), then the code as __main__.
PRELUDE = r'''
import os, resource, sys
cfg = {cfg!r}
for name, value in cfg["rlimits"]:
    resource.setrlimit(getattr(resource, name), value)
if os.getuid() == 0 and cfg["drop_root"]:
    os.setgroups([]); os.setgid(cfg["uid"]); os.setuid(cfg["uid"])
resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
if cfg["hook"]:
    allowed_read = tuple(cfg["read_roots"])
    here = os.path.realpath(os.getcwd())
    blocked = ("socket.__new__", "socket.connect", "socket.bind", "os.fork", "os.forkpty",
               "os.posix_spawn", "os.exec", "os.spawn", "os.system", "subprocess.Popen",
               "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.dlopen", "ctypes.dlsym",
               "ctypes.cdata", "os.chdir", "os.chroot", "os.setuid", "resource.setrlimit",
               "resource.prlimit")
    def _hook(event, args, _real=os.path.realpath, _here=here, _read=allowed_read,
              _blocked=blocked, _pid=os.getpid()):
        if event == "import" and args and str(args[0]).split(".")[0] in ("ctypes", "_ctypes", "cffi"):
            raise PermissionError("sandbox: " + str(args[0]) + " is not allowed")
        if event in _blocked:
            if event == "os.kill" and args and args[0] in (0, _pid):
                return
            raise PermissionError("sandbox: " + event + " is not allowed")
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            path = args[0].decode() if isinstance(args[0], bytes) else args[0]
            mode = str(args[1]) if len(args) > 1 and args[1] is not None else "r"
            full = _real(path)
            if full == _here or full.startswith(_here + os.sep):
                return
            writing = any(c in mode for c in "wax+") or (isinstance(args[2], int) and args[2] & 3)
            if not writing and (full.startswith(_read) or full in ("/dev/null", "/dev/urandom")):
                return
            raise PermissionError("sandbox: opening " + path + " is not allowed")
    sys.addaudithook(_hook)
sys.path.extend(p for p in cfg["site"] if p not in sys.path)
sys.argv = ["main.py"]
import runpy
runpy.run_path("main.py", run_name="__main__")
'''


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """cpu_s / wall_s seconds, memory_mb (address space), processes, output_bytes
    (stdout + stderr), file_mb (largest file written)."""

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 1024
    processes: int = 16
    output_bytes: int = 16384
    file_mb: int = 16

    def __post_init__(self):
        for name in ("cpu_s", "wall_s", "memory_mb", "processes", "output_bytes", "file_mb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ValueError(f"SandboxLimits.{name} must be a finite number > 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one run gave: stdout / stderr (each at most output_bytes, decoded with
    replacement), exit_code (None if killed), killed (why it was stopped, else None),
    seconds (wall), isolation ("bubblewrap" | "rlimits")."""

    stdout: str
    stderr: str
    exit_code: int | None
    killed: str | None
    seconds: float
    isolation: str

    @property
    def ok(self) -> bool:
        return self.killed is None and self.exit_code == 0

    def observation(self, max_chars: int = 2000) -> str:
        """The text an environment shows the model: stdout; on an error, the traceback's
        last line; when stopped, 'killed: <why>'."""
        tail = None
        if self.killed is not None:
            tail = f"killed: {self.killed}"
        elif self.exit_code:
            lines = [x for x in self.stderr.strip().splitlines() if x.strip()]
            tail = lines[-1][-300:] if lines else f"error: exit code {self.exit_code}"
        out = self.stdout.rstrip("\n")
        if len(out) > max_chars:
            out = out[:max_chars] + "\n[output truncated]"
        text = "\n".join(x for x in (out, tail) if x)
        return text or "(no output)"


@functools.lru_cache(maxsize=1)
def isolation() -> str:
    """"bubblewrap" if `bwrap` is installed and can make its namespaces here, else
    "rlimits" (module doc)."""
    if shutil.which("bwrap") is None:
        return "rlimits"
    try:
        probe = subprocess.run(_bwrap_args(tempfile.gettempdir()) + ["/bin/true"], timeout=20,
                               capture_output=True)
    except (OSError, subprocess.SubprocessError):
        return "rlimits"
    return "bubblewrap" if probe.returncode == 0 else "rlimits"


def _python_home() -> str:
    return os.path.realpath(sys.base_prefix)


def _bwrap_args(workdir: str) -> list[str]:
    home = _python_home()
    args = ["bwrap", "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/bin", "/bin",
            "--ro-bind", home, "/python", "--proc", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--bind", workdir, "/sandbox", "--chdir", "/sandbox",
            "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--die-with-parent", "--new-session", "--setenv", "HOME", "/sandbox",
            "--setenv", "PATH", "/python/bin:/usr/bin"]
    if os.getuid() == 0:  # the prelude drops to nobody: it needs these two until it does
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return args


def _site_dirs() -> list[str]:
    """Where the interpreter's packages live (read-only in the sandbox)."""
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return sorted(os.path.realpath(p) for p in paths if p)


def _site_packages(mode: str) -> list[str]:
    """The interpreter's package dirs as the code sees them (inside bubblewrap: under
    /python when they live under the Python prefix; others are not mounted)."""
    home = _python_home()
    dirs = [os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")]
    if mode == "rlimits":
        return sorted(set(dirs))
    return sorted({"/python/" + os.path.relpath(d, home) for d in dirs
                   if d == home or d.startswith(home + os.sep)})


def _rlimits(limits: SandboxLimits) -> list[tuple[str, tuple[int, int]]]:
    """The limits the sandboxed interpreter sets on itself first thing (in the child: a
    preexec_fn would run Python between fork and exec in this multithreaded process)."""
    mem = int(limits.memory_mb) << 20
    fsize = int(limits.file_mb) << 20
    cpu = max(1, int(math.ceil(limits.cpu_s)))
    return [("RLIMIT_CPU", (cpu, cpu + 1)), ("RLIMIT_AS", (mem, mem)),
            ("RLIMIT_FSIZE", (fsize, fsize)), ("RLIMIT_CORE", (0, 0))]


def _processes_of(uid: int) -> int:
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                n += os.stat(f"/proc/{d}").st_uid == uid
            except OSError:
                continue
    return n


def _read_capped(stream, cap: int, box: list, over: threading.Event) -> None:
    """Read a pipe to EOF, keeping at most `cap` bytes; set `over` past it."""
    kept = bytearray()
    while True:
        chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
        if not chunk:
            break
        room = cap - len(kept)
        if room > 0:
            kept += chunk[:room]
        if len(chunk) > max(room, 0):
            over.set()
            break
    box.append(bytes(kept))


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *,
               mode: str | None = None) -> SandboxResult:
    """Run `code` as a script in the sandbox (module doc); mode: "bubblewrap" | "rlimits"
    (None: the strongest this machine has, with a one-line warning when that is the
    fallback). Never raises for what the code does."""
    mode = mode or isolation()
    if mode not in ISOLATIONS:
        raise ValueError(f"sandbox mode must be one of {ISOLATIONS}, got {mode!r}")
    if mode == "rlimits":
        _warn_fallback()
    root = os.getuid() == 0
    run_uid = NOBODY if root and mode == "bubblewrap" else os.getuid()
    workdir = tempfile.mkdtemp(prefix="tandem-sandbox-")
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        if root:
            os.chown(workdir, NOBODY, NOBODY)
            os.chown(os.path.join(workdir, "main.py"), NOBODY, NOBODY)
        os.chmod(workdir, 0o700)
        read_roots = [_python_home(), "/usr"] + _site_dirs()
        if mode == "bubblewrap":
            read_roots = ["/python", "/usr"]
        # rlimits as root: nobody could not read an interpreter under /root (pyenv), so the
        # code keeps uid 0 and the audit hook refuses processes, signals and files
        cfg = {"drop_root": root and mode == "bubblewrap", "uid": NOBODY,
               "nproc": _processes_of(run_uid) + int(limits.processes) + 1,
               "hook": mode == "rlimits", "read_roots": read_roots,
               "site": _site_packages(mode), "rlimits": _rlimits(limits)}
        prelude = PRELUDE.format(cfg=cfg)
        env = {"PATH": "/usr/bin:/bin", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
               "PYTHONHASHSEED": "0", "HOME": workdir, "LANG": "C.UTF-8"}
        if mode == "bubblewrap":
            exe = "/python/" + os.path.relpath(os.path.realpath(sys.executable),
                                                   _python_home())
            cmd = _bwrap_args(workdir) + [exe, "-I", "-c", prelude]
            cwd = workdir
        else:
            cmd, cwd = [sys.executable, "-I", "-c", prelude], workdir
        return _supervise(cmd, cwd, env, limits, mode)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _supervise(cmd: list[str], cwd: str, env: dict, limits: SandboxLimits,
               mode: str) -> SandboxResult:
    """Start, read (capped), wait (wall limit), kill the whole session if needed."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    over = threading.Event()
    cap = int(limits.output_bytes)
    out: list[bytes] = []
    err: list[bytes] = []
    readers = [threading.Thread(target=_read_capped, args=(proc.stdout, cap, out, over), daemon=True),
               threading.Thread(target=_read_capped, args=(proc.stderr, cap, err, over), daemon=True)]
    for r in readers:
        r.start()
    killed = None
    deadline = t0 + float(limits.wall_s)
    while proc.poll() is None:
        if over.is_set():
            killed = f"over {cap} bytes of output"
        elif time.monotonic() > deadline:
            killed = f"over {limits.wall_s:g} s wall time"
        if killed is not None:
            _kill_session(proc)
            break
        time.sleep(0.01)
    proc.wait()
    for r in readers:
        r.join(2.0)
    proc.stdout.close()
    proc.stderr.close()
    code = proc.returncode
    if mode == "bubblewrap" and code is not None and code > 128:
        code = -(code - 128)  # bwrap's pid 1 reports a signal death as 128 + signal
    if killed is None and code is not None and code < 0:
        sig = -code
        killed = (f"over {limits.cpu_s:g} s of CPU time" if sig == signal.SIGXCPU
                  else f"over {limits.file_mb} MB written to a file" if sig == signal.SIGXFSZ
                  else f"signal {signal.Signals(sig).name}")
    if killed is None and code == 1 and over.is_set():
        killed = f"over {cap} bytes of output"
    stderr = (err[0] if err else b"").decode("utf-8", "replace")
    if killed is None and "MemoryError" in stderr:
        killed = f"over {limits.memory_mb} MB of memory"
    return SandboxResult(stdout=(out[0] if out else b"").decode("utf-8", "replace"),
                         stderr=stderr, exit_code=None if killed else code, killed=killed,
                         seconds=time.monotonic() - t0, isolation=mode)


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the code's whole session (setsid)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


@functools.lru_cache(maxsize=1)
def _warn_fallback() -> None:
    warnings.warn("sandbox: bubblewrap is not available here, so model code runs with rlimits, "
                  "a fresh temp dir and a Python audit hook only (weaker; rl/envs/sandbox.py)",
                  RuntimeWarning, stacklevel=3)


def sandbox_info() -> dict[str, Any]:
    """{"isolation": ..., "bwrap": path or None} for logs and results."""
    return {"isolation": isolation(), "bwrap": shutil.which("bwrap")}
