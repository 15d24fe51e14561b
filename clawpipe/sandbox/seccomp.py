"""The bwrap sandboxes' seccomp filter: Docker's default denials, as a classic BPF program built here.

bwrap loads the program (``--seccomp FD``) just before it execs the harness, so everything the harness
runs is filtered. Denied with EPERM: namespace creation and entry (unshare, setns, clone with any
CLONE_NEW* flag), the kernel keyring (keyctl, add_key, request_key), ptrace and cross-process memory
access, every mount call (old and new API), bpf, perf_event_open, userfaultfd, io_uring (a large kernel
attack surface that Docker's default denies since 25.0), kernel modules, kexec, and the
host-wide knobs (clock, hostname, swap, reboot, quotas, syslog). clone3 gets ENOSYS, because its flags
sit in memory a filter cannot read; the C library then falls back to clone, whose flags it can. A
syscall made under another architecture's calling convention (i386 or x32 on x86_64) kills the process:
its numbers mean different calls, and a filter keyed on the native ones would let them through.
socket() of the AF_VSOCK family is denied too (as Docker's default profile does): vsock reaches the
hypervisor of a virtual machine directly, past the sandbox's network namespace, which does not cover it.

The docker backend stacks the same program on the engine's own profile (an engine older than 25.0 lets
vsock through): :func:`loader_command` loads it in the container just before the harness is exec'd.

The program: check the architecture, load the syscall number, compare it with each denied number, allow
the rest (clone and socket go on to a check of their first argument). Built for x86_64 and aarch64 (the
numbers are in :data:`SYSCALLS`).
"""

from __future__ import annotations

import errno
import os
import platform
import struct
from dataclasses import dataclass

from clawpipe.errors import SandboxError

# struct sock_filter instruction classes (linux/bpf_common.h)
BPF_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
BPF_JGE_K = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
BPF_JSET_K = 0x05 | 0x40 | 0x00  # BPF_JMP | BPF_JSET | BPF_K
BPF_RET_K = 0x06 | 0x00  # BPF_RET | BPF_K

SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000

# struct seccomp_data offsets: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
OFF_NR, OFF_ARCH, OFF_ARG0_LOW = 0, 4, 16  # args[0]'s low 32 bits (both architectures are little-endian)

X32_SYSCALL_BIT = 0x40000000
AF_VSOCK = 40
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
# NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET


@dataclass(frozen=True, slots=True)
class Arch:
    name: str
    audit: int  # AUDIT_ARCH_* (linux/audit.h)
    column: int  # index into the SYSCALLS rows


ARCHES = {
    "x86_64": Arch("x86_64", 0xC000003E, 0),
    "aarch64": Arch("aarch64", 0xC00000B7, 1),
}

# name: (x86_64, aarch64); None where the architecture has no such call.
SYSCALLS: dict[str, tuple[int | None, int | None]] = {
    "unshare": (272, 97),
    "setns": (308, 268),
    "clone": (56, 220),
    "clone3": (435, 435),
    "socket": (41, 198),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438),
    "kcmp": (312, 272),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "acct": (163, 89),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "reboot": (169, 142),
    "sethostname": (170, 161),
    "setdomainname": (171, 162),
    "quotactl": (179, 60),
    "lookup_dcookie": (212, 18),
    "name_to_handle_at": (303, 264),
    "open_by_handle_at": (304, 265),
    "syslog": (103, 116),
    "vhangup": (153, 58),
    "settimeofday": (164, 170),
    "clock_settime": (227, 112),
    "clock_adjtime": (305, 266),
    "adjtimex": (159, 171),
    "fanotify_init": (300, 262),
    "iopl": (172, None),
    "ioperm": (173, None),
    "uselib": (134, None),
}
SPECIAL = ("clone", "clone3", "socket")  # filtered by an argument / answered ENOSYS, not denied outright


def host_arch() -> Arch:
    machine = platform.machine()
    if machine not in ARCHES:
        raise SandboxError(
            f"no seccomp filter for {machine!r} (only {sorted(ARCHES)}); use the docker backend on this machine"
        )
    return ARCHES[machine]


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def build_filter(arch: Arch | None = None) -> bytes:
    """The filter program (an array of struct sock_filter) for ``arch`` (default: this machine's)."""
    arch = arch or host_arch()
    numbers = {name: n[arch.column] for name, n in SYSCALLS.items()}
    denied = sorted(nr for name, nr in numbers.items() if name not in SPECIAL and nr is not None)
    clone, clone3, sock = numbers["clone"], numbers["clone3"], numbers["socket"]
    assert clone is not None and clone3 is not None and sock is not None
    # After the comparisons: ALLOW, DENY, ENOSYS, KILL, then the clone check. A jump counts forward from the
    # next instruction, so each comparison's offset is computed from its own position.
    head: list[tuple[int, int, str | None]] = []  # (code, k, label jumped to when true)
    head.append((BPF_LD_W_ABS, OFF_ARCH, None))
    head.append((BPF_JEQ_K, arch.audit, "arch_ok"))  # another architecture falls through to the KILL
    head.append((BPF_RET_K, SECCOMP_RET_KILL_PROCESS, None))
    head.append((BPF_LD_W_ABS, OFF_NR, None))  # "arch_ok"
    if arch.name == "x86_64":
        head.append((BPF_JGE_K, X32_SYSCALL_BIT, "kill"))
    head.extend((BPF_JEQ_K, nr, "deny") for nr in denied)
    head.append((BPF_JEQ_K, clone3, "enosys"))
    head.append((BPF_JEQ_K, clone, "clone"))
    head.append((BPF_JEQ_K, sock, "socket"))
    labels = {"arch_ok": 3}
    n = len(head)
    labels.update({"allow": n, "deny": n + 1, "enosys": n + 2, "kill": n + 3, "clone": n + 4, "socket": n + 8})
    out = []
    for i, (code, k, target) in enumerate(head):
        if target is None:
            out.append(_insn(code, k))
            continue
        jump = labels[target] - (i + 1)
        if not 0 <= jump <= 255:
            raise AssertionError(f"seccomp jump of {jump} does not fit")
        out.append(_insn(code, k, jt=jump, jf=0))
    out.append(_insn(BPF_RET_K, SECCOMP_RET_ALLOW))
    out.append(_insn(BPF_RET_K, SECCOMP_RET_ERRNO | errno.EPERM))
    out.append(_insn(BPF_RET_K, SECCOMP_RET_ERRNO | errno.ENOSYS))
    out.append(_insn(BPF_RET_K, SECCOMP_RET_KILL_PROCESS))
    # "clone": deny any namespace flag, allow the rest (threads, fork, vfork).
    out.append(_insn(BPF_LD_W_ABS, OFF_ARG0_LOW))
    out.append(_insn(BPF_JSET_K, CLONE_NEW_FLAGS, jt=1, jf=0))
    out.append(_insn(BPF_RET_K, SECCOMP_RET_ALLOW))
    out.append(_insn(BPF_RET_K, SECCOMP_RET_ERRNO | errno.EPERM))
    # "socket": deny the vsock family (the domain is an int: its low 32 bits are all of it), allow the rest.
    out.append(_insn(BPF_LD_W_ABS, OFF_ARG0_LOW))
    out.append(_insn(BPF_JEQ_K, AF_VSOCK, jt=1, jf=0))
    out.append(_insn(BPF_RET_K, SECCOMP_RET_ALLOW))
    out.append(_insn(BPF_RET_K, SECCOMP_RET_ERRNO | errno.EPERM))
    return b"".join(out)


# Run by the sandbox's Python (-I -S: nothing of the sandbox's is imported) as: LOADER <program hex> <command...>.
# no_new_privs first (the kernel requires it of an unprivileged filter), then the filter, then exec; a command
# that cannot start exits 127 with the shell's message, as it did when the shell exec'd it. The one trace it
# leaves: where the harness's declared locale is C or POSIX, Python has set LC_CTYPE=C.UTF-8 (its locale
# coercion, which -I leaves on), and the harness inherits that.
LOADER = """
import ctypes, os, sys
prog = ctypes.create_string_buffer(bytes.fromhex(sys.argv[1]))
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
fprog = Fprog((len(prog) - 1) // 8, ctypes.addressof(prog))
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0):
    sys.exit("clawpipe: cannot load the sandbox's seccomp filter: " + os.strerror(ctypes.get_errno()))
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    print(f"sh: 1: {sys.argv[2]}: {exc.strerror}", file=sys.stderr)
    sys.exit(127)
"""


def loader_command(python: str, arch: Arch | None = None) -> list[str]:
    """The argv prefix that loads :func:`build_filter`'s program with ``python`` and then execs the rest."""
    return [python, "-I", "-S", "-c", LOADER, build_filter(arch).hex()]


def memfd_with(data: bytes, name: str) -> int:
    """An in-memory file holding ``data``, positioned at its start (for bwrap's FD arguments)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
