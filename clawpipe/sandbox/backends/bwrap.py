"""The bwrap backend (default): bubblewrap namespaces, a cgroup, the bridge, and a host uid per sandbox.

bwrap runs as root *without* a user namespace so it can bind paths the sandbox user could not reach
(the Python install under /root, mode 700); inside, ``setpriv`` drops to the job's uid/gid (one of its
own from clawpipe.sandbox.uids, so no kernel per-uid budget is shared with a neighbour) with no
capabilities, no supplementary groups and no_new_privs before exec'ing the harness. The sandbox sees:
/usr (ro) and its /bin /lib symlinks, a few /etc files (passwd/group name its uid "sandbox"), the Python
environment (ro), the harness folder at /harness (ro), the task at /task.json (ro), its work dir at
/workdir (rw, owned by its uid), a private /tmp, /proc and /dev, and a network namespace whose only
listener is the bridge's 127.0.0.1:PORT.

Start-up: bwrap reports the sandbox's pid on --json-status-fd and waits on --block-fd; meanwhile the host
puts that pid into the cgroup (or sets rlimits), opens the bridge listener in its network namespace, and
then releases it. The same pipe later says whether the command ran and exited ("exit-code"): only without
that is an exit status of 1 bwrap's own failure to build the sandbox, whatever the harness wrote to stderr.
A timeout SIGKILLs the namespace's pid 1, which takes every descendant with it.

Like Docker's defaults: a seccomp filter (clawpipe.sandbox.seccomp) on everything the harness runs, and a
fresh session keyring per sandbox (joined by the launching thread just before bwrap starts; a thread's
keyrings are its own, and the child inherits them). Nothing secret or host-specific is on a command line:
bwrap's options, the harness's environment (its key) and every host path among them, arrive through
``--args FD`` (an in-memory file), so host ``ps`` and the sandbox's /proc/1/cmdline show only
``bwrap --args N -- setpriv ... <the manifest's command>``; bwrap itself starts with an empty environment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from clawpipe.errors import SandboxError
from clawpipe.sandbox.backends.base import (
    INNER_HARNESS,
    INNER_KIT,
    INNER_TASK,
    INNER_WORKDIR,
    Outcome,
    PythonEnv,
    SandboxJob,
    confine,
    decode_shell_status,
    detach_route,
    harness_env,
    identity_files,
    reap_cgroup,
    wait_for_exit,
)
from clawpipe.sandbox.bridge import Bridge, listen_in_netns
from clawpipe.sandbox.limits import Cgroup, CgroupLayout, detect_cgroups, sweep_stale_cgroups
from clawpipe.sandbox.seccomp import build_filter, memfd_with
from clawpipe.sandbox.uids import SandboxUser

logger = logging.getLogger(__name__)

# /etc entries a harness may need (dynamic linker cache, time zone, alternatives symlinks, CA certs).
# /etc is one read-only folder per sandbox uid, built on the uid's first use: hard links to copies of the
# few files a harness needs, identity files that know that uid, and mount points for the two host folders
# bound into it (fewer mounts, faster start-up than binding each file).
ETC_COPIES = ("ld.so.cache", "localtime", "mime.types")
ETC_DIR_BINDS = ("alternatives", "ssl")
INFO_TIMEOUT_S = 10.0
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
KEYCTL_JOIN_SESSION_KEYRING = 1
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_keyring_warned = False


def join_fresh_session_keyring() -> int:
    """Give the calling thread a new anonymous session keyring; processes it starts next inherit it.

    Returns the keyring's serial, or 0 where keyctl is refused (e.g. a container's own seccomp profile),
    which is logged once: the sandbox's filter denies keyctl anyway.
    """
    global _keyring_warned
    nr = SYS_KEYCTL.get(platform.machine())
    serial = -1 if nr is None else _libc.syscall(ctypes.c_long(nr), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None)
    if serial >= 0:
        return int(serial)
    err = ctypes.get_errno() if nr is not None else errno.ENOSYS
    if not _keyring_warned:
        _keyring_warned = True
        logger.warning("no fresh session keyring per sandbox (keyctl: %s)", os.strerror(err))
    return 0


def _etc_skeleton() -> Path:
    """The files of a sandbox's /etc that do not depend on its uid (the per-uid folders link to them)."""
    d = Path(tempfile.mkdtemp(prefix="clawpipe-etc-"))
    (d / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    (d / "nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files\n")
    (d / "resolv.conf").write_text("")  # no DNS in a sandbox
    for name in ETC_COPIES:
        src = Path("/etc", name)
        if src.is_file():
            shutil.copyfile(src, d / name)
    for f in d.iterdir():
        f.chmod(0o644)
    d.chmod(0o700)  # the per-uid folders beside it are what sandboxes see
    return d


def _etc_for(skeleton: Path, user: SandboxUser) -> Path:
    """A sandbox /etc for ``user`` next to ``skeleton``: its identity files, links to the shared ones."""
    d = skeleton.with_name(f"{skeleton.name}-{user.uid}")
    staging = Path(tempfile.mkdtemp(prefix=f"{d.name}.", dir=d.parent))
    for f in skeleton.iterdir():
        os.link(f, staging / f.name)
    passwd, group = identity_files(user)
    for name, text in (("passwd", passwd), ("group", group)):
        (staging / name).write_text(text)
        (staging / name).chmod(0o644)
    for name in ETC_DIR_BINDS:
        if Path("/etc", name).is_dir():
            (staging / name).mkdir(mode=0o755)
    staging.chmod(0o755)
    staging.rename(d)  # whole or not at all
    return d


def command_exited(status_r: int, status: bytes) -> bool:
    """Whether bwrap's --json-status-fd documents (``status``, then the rest of the pipe ``status_r``) hold
    the command's "exit-code"."""
    while chunk := os.read(status_r, 4096):
        status += chunk
    return b'"exit-code"' in status


def _status_fd_option(bwrap: str) -> str:
    """--json-status-fd (bwrap >= 0.5: it also reports the command's exit), else --info-fd."""
    try:
        text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "--info-fd"
    if "--json-status-fd" in text:
        return "--json-status-fd"
    logger.warning(
        "bwrap older than 0.5: a harness exiting 1 after printing 'bwrap: ...' would count as a sandbox failure"
    )
    return "--info-fd"


def _mkdirs_args(dest: Path, made: set[str]) -> list[str]:
    """--dir entries (mode 0755) for every missing parent of ``dest``; bwrap would make them 0700."""
    args: list[str] = []
    for parent in reversed(dest.parents):
        s = str(parent)
        if s == "/" or s in made:
            continue
        made.add(s)
        args += ["--perms", "0755", "--dir", s]
    return args


class BwrapBackend:
    """Run harnesses under bubblewrap. One instance serves many concurrent rollouts."""

    name = "bwrap"

    def __init__(
        self,
        *,
        python: PythonEnv | None = None,
        inner_port: int = 8000,
        cgroups: CgroupLayout | None = None,
        bwrap: str | None = None,
        tmpfs_mb: int = 256,
    ) -> None:
        self.bwrap = bwrap or shutil.which("bwrap") or ""
        if not self.bwrap:
            raise SandboxError("bubblewrap not found: apt-get install -y bubblewrap (or choose --backend process)")
        self.setpriv = shutil.which("setpriv") or ""
        if not self.setpriv.startswith("/usr/"):
            raise SandboxError("setpriv (util-linux) not found under /usr: apt-get install -y util-linux")
        if os.geteuid() != 0:
            raise SandboxError(
                "the bwrap backend runs bwrap as root so each sandbox can drop to a uid of its own; run as root "
                "(or use --backend docker / process)"
            )
        self.python = python or PythonEnv.current()
        self.inner_port = inner_port
        self.tmpfs_mb = tmpfs_mb
        self.cgroups = cgroups if cgroups is not None else detect_cgroups()
        sweep_stale_cgroups(self.cgroups)
        self._etc = _etc_skeleton()
        self._etc_dirs: dict[SandboxUser, Path] = {}
        self._etc_lock = threading.Lock()
        self._seccomp = build_filter()
        self._status_fd = _status_fd_option(self.bwrap)
        self._before_etc, self._after_etc = self._static_args()

    def _static_args(self) -> tuple[list[str], list[str]]:
        """bwrap's options that every job shares: those before the job's /etc and those after it."""
        args = [
            self.bwrap,
            "--unshare-ipc",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--hostname",
            "sandbox",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--ro-bind",
            "/usr",
            "/usr",
        ]
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / top
            if host.is_symlink():
                args += ["--symlink", os.readlink(host), f"/{top}"]
            elif host.is_dir():
                args += ["--ro-bind", str(host), f"/{top}"]
        # /tmp and /dev/shm: private tmpfs, world-writable+sticky like a real one (charged to the memory limit).
        size = str(self.tmpfs_mb << 20)
        args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]
        args += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
        # After the sandbox's own /etc (bound per job): the host folders inside it, the Python environment.
        after: list[str] = []
        for name in ETC_DIR_BINDS:
            if Path("/etc", name).is_dir():
                after += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
        made: set[str] = {"/etc", "/tmp", "/proc", "/dev", "/usr"}
        for p in self.python.mounts():
            after += _mkdirs_args(p, made)
            after += ["--ro-bind", str(p), str(p)]
            made.add(str(p))
        self._made = made
        return args, after

    def etc_dir(self, user: SandboxUser) -> Path:
        """The /etc folder of sandboxes running as ``user`` (made on the uid's first use)."""
        with self._etc_lock:
            d = self._etc_dirs.get(user)
            if d is None:
                d = self._etc_dirs[user] = _etc_for(self._etc, user)
            return d

    def command(self, job: SandboxJob, info_w: int, block_r: int, seccomp_fd: int) -> list[str]:
        """bwrap's whole argument list; :meth:`run` passes the options (everything before "--") through ``--args``."""
        env = harness_env(
            job, port=self.inner_port, workdir=INNER_WORKDIR, task_path=INNER_TASK, path_dirs=[str(self.python.bin)]
        )
        args = [*self._before_etc, "--ro-bind", str(self.etc_dir(job.user)), "/etc", *self._after_etc]
        made = set(self._made)
        for p in job.manifest.ro_paths:
            args += _mkdirs_args(p, made)
            args += ["--ro-bind", str(p), str(p)]
        args += ["--ro-bind", str(job.manifest.dir), INNER_HARNESS]
        if job.manifest.kit_dir is not None:
            args += ["--ro-bind", str(job.manifest.kit_dir), INNER_KIT]
        args += ["--bind", str(job.workdir), INNER_WORKDIR, "--chdir", INNER_WORKDIR]
        args += ["--ro-bind", str(job.task_path), INNER_TASK]
        args += [self._status_fd, str(info_w), "--block-fd", str(block_r), "--seccomp", str(seccomp_fd)]
        for k, v in env.items():
            args += ["--setenv", k, v]
        args += [
            "--",
            self.setpriv,
            f"--reuid={job.user.uid}",
            f"--regid={job.user.gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
            *job.manifest.resolve_command(INNER_HARNESS),
        ]
        return args

    def run(self, job: SandboxJob, bridge: Bridge) -> Outcome:
        t0 = time.monotonic()
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        out = Outcome()
        cgroup: Cgroup | None = None
        route = None
        proc: subprocess.Popen[bytes] | None = None
        seccomp_fd = args_fd = -1
        try:
            seccomp_fd = memfd_with(self._seccomp, "clawpipe-seccomp")
            argv = self.command(job, info_w, block_r, seccomp_fd)
            cut = argv.index("--")  # bwrap takes options from --args, the command (setpriv ...) from argv
            args_fd = memfd_with(b"".join(os.fsencode(a) + b"\0" for a in argv[1:cut]), "clawpipe-bwrap-args")
            join_fresh_session_keyring()
            with open(job.stdout_path, "wb") as so, open(job.stderr_path, "wb") as se:
                proc = subprocess.Popen(
                    [argv[0], "--args", str(args_fd), *argv[cut:]],
                    stdin=subprocess.DEVNULL,
                    stdout=so,
                    stderr=se,
                    pass_fds=(info_w, block_r, seccomp_fd, args_fd),
                    close_fds=True,
                    env={},
                )
            for fd in (info_w, block_r, seccomp_fd, args_fd):
                os.close(fd)
            info_w = block_r = seccomp_fd = args_fd = -1
            child, status = self._read_child_pid(info_r, proc, job)
            cgroup = confine(child, job, self.cgroups)
            route = bridge.attach(listen_in_netns(child, self.inner_port))
            os.write(block_w, b"1")
            out.setup_ms = (time.monotonic() - t0) * 1000
            rc = wait_for_exit(proc, job.timeout_s)
            if rc is None:
                out.timed_out = True
                self._kill(child, proc, cgroup)
                rc = proc.wait()
            reap_cgroup(cgroup, out)  # pid 1 gone means the namespace is gone; this is belt and braces
            if not out.timed_out:
                if rc == 1 and not self._command_exited(info_r, status, job):
                    self._raise_setup_failed(job)
                out.exit_code, out.signal = decode_shell_status(rc)
            return out
        except SandboxError:
            raise
        except OSError as exc:
            raise SandboxError(f"bwrap sandbox for {job.rollout_id} failed to start: {exc}") from exc
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            if route is not None:
                detach_route(bridge, route, out)
            if cgroup is not None:
                cgroup.remove()
            for fd in (info_r, info_w, block_r, block_w, seccomp_fd, args_fd):
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass

    def _read_child_pid(self, info_r: int, proc: subprocess.Popen[bytes], job: SandboxJob) -> tuple[int, bytes]:
        """The sandbox's pid from bwrap's first status document, and what was read of the pipe after it."""
        buf = b""
        deadline = time.monotonic() + INFO_TIMEOUT_S
        decoder = json.JSONDecoder()
        while time.monotonic() < deadline:
            chunk = os.read(info_r, 4096)
            if not chunk:
                break
            buf += chunk
            try:
                text = buf.decode()
                info, end = decoder.raw_decode(text)
                return int(info["child-pid"]), text[end:].encode()
            except (ValueError, KeyError):
                continue
        proc.wait(timeout=5)
        err = job.stderr_path.read_text(errors="replace")[-2000:] if job.stderr_path.exists() else ""
        raise SandboxError(f"bwrap did not start (exit {proc.returncode}): {err.strip() or 'no output'}")

    def _command_exited(self, info_r: int, status: bytes, job: SandboxJob) -> bool:
        """Whether bwrap reported the command's exit (after bwrap exited, the pipe is read to its end).

        bwrap exits 1 both when the command did and when it could not build the sandbox; only in the first
        case does it write an "exit-code" document. Nothing in the sandbox holds this pipe. A bwrap older
        than 0.5 reports no exit: there a single "bwrap: ..." line on stderr stands for its own failure.
        """
        if self._status_fd != "--json-status-fd":
            text = job.stderr_path.read_bytes()[:4096].decode(errors="replace")
            return not (text.startswith("bwrap: ") and text.count("\n") <= 1)
        return command_exited(info_r, status)

    @staticmethod
    def _raise_setup_failed(job: SandboxJob) -> None:
        text = job.stderr_path.read_bytes()[:4096].decode(errors="replace").strip()
        raise SandboxError(f"bwrap could not set up the sandbox: {text or 'no output'}")

    @staticmethod
    def _kill(child: int, proc: subprocess.Popen[bytes], cgroup: Cgroup | None) -> None:
        try:
            os.kill(child, 9)  # pid 1 of the namespace: the kernel kills every process in it
        except ProcessLookupError:
            pass
        if cgroup is not None:
            cgroup.kill_all()
        proc.kill()

    def close(self) -> None:
        with self._etc_lock:
            for d in [self._etc, *self._etc_dirs.values()]:
                shutil.rmtree(d, ignore_errors=True)
            self._etc_dirs.clear()
