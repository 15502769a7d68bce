"""The sandbox that runs code written by the policy (the rewards `code_tests`, `verilog_tests`).

Every run gets its own temporary directory, an environment with nothing but PATH, CPU-time,
address-space, file-size and process-count limits, no core dumps, no new privileges, its own
session (process group) and a wall-clock timeout after which the whole group is killed. Its
output goes to a file, so no amount of printing can fill the trainer's memory.

Isolation (`sandbox.isolation`): where bubblewrap (`bwrap`) can create namespaces, the code
also runs without network (an empty network namespace), in its own PID namespace (nothing it
starts outlives the run), and sees a filesystem that holds only the system directories and the
interpreter or simulator, read-only, plus its own directory, writable, at `/sandbox`: not the
user's home, the run directory or the task's data and tests. Where namespaces are refused (no
bwrap, or a container that forbids user namespaces) the weaker `limits` mode runs: the limits
above without the namespaces. `auto` says so once in the log; `required` refuses to run.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mogrpo.errors import RewardError

log = logging.getLogger(__name__)

IsolationSetting = Literal["auto", "required", "off"]
ISOLATION_SETTINGS = ("auto", "required", "off")
INSTALL_BWRAP = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf "
                 "install bubblewrap)")
SANDBOX_DIR = "/sandbox"
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf")

# Where util-linux's `prlimit` is missing: runs first inside the sandbox, sets the limits on
# itself, then becomes the command. (Limits are set by the child, not in a preexec_fn, which is
# unsafe with the reward's worker threads.)
_LAUNCHER = """
import os, resource, sys
limits = dict(zip(("CPU", "AS", "FSIZE", "NPROC"), map(int, sys.argv[1:5])))
limits["CORE"] = 0
for name, value in limits.items():
    if value < 0:
        continue
    kind = getattr(resource, "RLIMIT_" + name)
    hard = resource.getrlimit(kind)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (value, value))
try:
    import ctypes
    ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid escalation
except Exception:
    pass
os.execv(sys.argv[5], sys.argv[5:])
"""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use."""

    timeout: float = 5.0
    """Wall-clock seconds before the process group is killed."""
    memory_mb: int = 1024
    """Address-space limit per process (RLIMIT_AS)."""
    file_size_mb: int = 16
    """Largest file the code may write, its output included (RLIMIT_FSIZE)."""
    processes: int = 64
    """Processes and threads inside an isolated sandbox (RLIMIT_NPROC, counted per user
    namespace from Linux 5.14; the kernel exempts root, and the `limits` mode leaves it unset
    because there it would count all of the user's processes)."""

    def __post_init__(self) -> None:
        if self.timeout <= 0 or self.memory_mb < 64 or self.file_size_mb < 1 or self.processes < 1:
            raise RewardError(
                f"sandbox: timeout {self.timeout}, memory_mb {self.memory_mb}, file_size_mb "
                f"{self.file_size_mb}, processes {self.processes}: need timeout > 0, memory_mb "
                ">= 64, file_size_mb >= 1 and processes >= 1")


@dataclass(frozen=True)
class Isolation:
    """How runs are contained: `namespaces` (bwrap) or `limits` (the weaker mode)."""

    mode: Literal["namespaces", "limits"]
    reason: str = ""
    """Why the weaker mode runs (empty for `namespaces`)."""


@dataclass(frozen=True)
class Outcome:
    """What a sandboxed command did."""

    returncode: int | None
    """Exit status (negative: killed by that signal); None when it timed out."""
    stdout: str
    """Its standard output (at most `file_size_mb`)."""

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def _bwrap_prefix(workdir: Path, readonly: Sequence[str]) -> list[str]:
    """bwrap's arguments: namespaces, the read-only system and tools, `workdir` at /sandbox."""
    args = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--unshare-user",
            "--cap-drop", "ALL", "--die-with-parent", "--new-session",
            "--proc", "/proc", "--dev", "/dev"]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):  # merged /usr: /lib -> usr/lib
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in _SYSTEM_FILES:
        args += ["--ro-bind-try", path, path]
    bound: list[str] = ["/usr"]
    for path in readonly:
        real = os.path.realpath(path)
        if os.path.isdir(real) and not any(real == b or real.startswith(b + "/") for b in bound):
            args += ["--ro-bind", real, real]
            bound.append(real)
    return args + ["--bind", str(workdir), SANDBOX_DIR, "--chdir", SANDBOX_DIR]


def interpreter_dirs() -> list[str]:
    """Where this Python lives (a virtual environment and its base): bound read-only."""
    return list(dict.fromkeys([sys.prefix, sys.base_prefix,
                               os.path.dirname(os.path.realpath(sys.executable))]))


def _nproc_counted_per_namespace() -> bool:
    release = os.uname().release.split(".")
    try:
        return (int(release[0]), int(release[1].split("-")[0])) >= (5, 14)
    except (ValueError, IndexError):
        return False


def _limit_prefix(limits: SandboxLimits, nproc: int, isolated: bool) -> list[str]:
    """The command that sets the limits (and no new privileges) and then runs the rest: util-linux's
    `prlimit` (and `setpriv`; bwrap already sets it) where found, else the Python launcher."""
    values = {"cpu": int(limits.timeout) + 1, "as": limits.memory_mb * 2**20,
              "fsize": limits.file_size_mb * 2**20, "nproc": nproc}
    prlimit, setpriv = shutil.which("prlimit"), shutil.which("setpriv")
    if prlimit and (isolated or setpriv):
        prefix = [prlimit, "--core=0", *(f"--{k}={v}" for k, v in values.items() if v >= 0), "--"]
        return prefix if isolated else [*prefix, setpriv or "", "--no-new-privs"]
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, *(str(v) for v in values.values())]


def run_sandboxed(argv: Sequence[str], workdir: Path, limits: SandboxLimits,
                  isolation: Isolation, *, stdin: str = "",
                  readonly: Sequence[str] = ()) -> Outcome:
    """Run `argv` (an absolute program path first) in `workdir` under `limits` and `isolation`.

    `readonly`: directories the command needs besides the system ones (its installation), bound
    read-only under isolation. Inside an isolated run `workdir` is `/sandbox`."""
    isolated = isolation.mode == "namespaces"
    nproc = limits.processes if isolated and _nproc_counted_per_namespace() else -1
    launch = [*_limit_prefix(limits, nproc, isolated), *argv]
    command = [*_bwrap_prefix(workdir, [*interpreter_dirs(), *readonly]), *launch] if isolated \
        else launch
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8",
           "TMPDIR": SANDBOX_DIR if isolated else str(workdir)}
    with tempfile.TemporaryFile() as out:  # outside workdir: the code cannot see it
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.PIPE,
                                stdout=out, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.communicate(stdin.encode(), timeout=limits.timeout)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _kill_group(proc)  # whatever the code left running in its session
        out.seek(0)
        text = out.read(limits.file_size_mb * 2**20 + 1).decode("utf-8", "replace")
    return Outcome(code, text)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass
    proc.wait()


@functools.lru_cache(maxsize=1)
def probe_isolation() -> Isolation:
    """Whether this machine lets bwrap create the namespaces (checked once per process)."""
    if not sys.platform.startswith("linux"):
        return Isolation("limits", f"namespaces are a Linux feature (this is {sys.platform})")
    if shutil.which("bwrap") is None:
        return Isolation("limits", f"bubblewrap (bwrap) is not installed; {INSTALL_BWRAP}")
    with tempfile.TemporaryDirectory(prefix="mogrpo-probe-") as tmp:
        argv = [*_bwrap_prefix(Path(tmp), interpreter_dirs()), sys.executable, "-I", "-S",
                "-c", "pass"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                                  env={"PATH": "/usr/bin:/bin"})
        except (OSError, subprocess.TimeoutExpired) as err:
            return Isolation("limits", f"bwrap could not start ({err})")
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return Isolation("limits", f"the kernel refused the namespaces (bwrap: {said})")
    return Isolation("namespaces")


def check_isolation_setting(setting: Any) -> None:
    """A RewardError unless `setting` is one of `ISOLATION_SETTINGS`."""
    if setting not in ISOLATION_SETTINGS:
        raise RewardError(f"sandbox isolation {setting!r}: use one of {', '.join(ISOLATION_SETTINGS)}")


def resolve_isolation(setting: str) -> Isolation:
    """The isolation a run gets for `sandbox.isolation` = `setting`: `auto` (namespaces where
    the machine allows, else `limits`, said once in the log), `required` (namespaces or a
    RewardError) or `off` (`limits`)."""
    check_isolation_setting(setting)
    if setting == "off":
        return Isolation("limits", "sandbox.isolation is off")
    found = probe_isolation()
    if found.mode == "namespaces":
        return found
    if setting == "required":
        raise RewardError(
            f"sandbox.isolation = required, but this machine cannot isolate generated code: "
            f"{found.reason}. Fix that, or set sandbox.isolation: auto to run in the weaker "
            "`limits` mode (CPU, memory, file-size limits and a timeout; no network or "
            "filesystem isolation)")
    _warn_once(found.reason)
    return found


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("sandbox: generated code runs in the weaker `limits` mode (CPU, memory and "
                "file-size limits, timeout; it can reach the network and read the user's "
                "files) because %s. Set sandbox.isolation: required to refuse this.", reason)
