"""The sandbox's seccomp filter: a classic-BPF program, built here in pure Python, that bubblewrap loads
(`--seccomp FD`) just before it starts the sandbox's init.

It is a deny list on top of what the confinement already removed (capabilities, a nested user
namespace): the calls that change mounts or namespaces, inspect other processes, or reach kernel
subsystems a Python program never needs fail with EPERM, so even a kernel bug behind one of them is
out of reach. In order, for each system call:

    arch != x86_64                      -> kill the process (the i386 and x32 entry points have other numbers)
    nr >= 0x40000000 (x32 ABI)          -> EPERM
    nr in DENIED (+ memfd_create)       -> EPERM
    nr == clone and flags & CLONE_NEW*  -> EPERM (a clone that makes namespaces)
    nr == clone3                        -> ENOSYS (its flags are behind a pointer; libc then falls back to clone)
    nr == socket and family == AF_VSOCK -> EPERM (vsock talks to the hypervisor's host, and no namespace confines it)
    otherwise                           -> allow

Only x86_64 has a table; elsewhere `deny_filter` raises and the sandbox refuses to start (fail closed).
"""

import errno
import os
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
OFFSET_NR, OFFSET_ARCH, OFFSET_ARG0 = 0, 4, 16
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
AF_VSOCK = 40
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080
# NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME

X86_64 = {  # from asm/unistd_64.h
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "move_mount": 429, "open_tree": 428,
    "mount_setattr": 442, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "swapon": 167, "swapoff": 168, "reboot": 169, "acct": 163, "quotactl": 179, "open_by_handle_at": 304,
    "name_to_handle_at": 303, "syslog": 103, "iopl": 172, "ioperm": 173, "lookup_dcookie": 212, "vhangup": 153,
    "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159, "sethostname": 170,
    "setdomainname": 171, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "uselib": 134, "fanotify_init": 300, "shmget": 29, "msgget": 68, "memfd_create": 319,
    "clone": 56, "clone3": 435, "socket": 41,
}
# SysV shared memory and message queues: an IPC namespace's defaults allow gigabytes, which no rlimit bounds
DENIED = [name for name in X86_64 if name not in ("memfd_create", "clone", "clone3", "socket")]


def deny_filter(deny_memfd: bool) -> bytes:
    """The filter as `struct sock_filter[]` bytes. `deny_memfd`: also refuse memfd_create (no memory cgroup
    counts its pages, so only the deny bounds it)."""
    if os.uname().machine != "x86_64":
        raise OSError(f"the sandbox's seccomp filter has no system-call table for {os.uname().machine}")
    numbers = [X86_64[name] for name in DENIED] + [X86_64["memfd_create"]] * deny_memfd
    # layout: header (5) | one jeq per denied call | jeq clone | jeq clone3 | jeq socket | allow | clone check (3) |
    # socket check (3) | deny | enosys
    head = 5
    clone_at = head + len(numbers)
    allow_at = clone_at + 3
    check_at = allow_at + 1
    socket_at = check_at + 3
    deny_at = socket_at + 3
    enosys_at = deny_at + 1
    program = [
        (BPF_LD_W_ABS, 0, 0, OFFSET_ARCH),
        (BPF_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        (BPF_RET_K, 0, 0, RET_KILL_PROCESS),
        (BPF_LD_W_ABS, 0, 0, OFFSET_NR),
        (BPF_JGE_K, deny_at - 5, 0, X32_SYSCALL_BIT),
    ]
    for number in numbers:
        program.append((BPF_JEQ_K, deny_at - (len(program) + 1), 0, number))
    program.append((BPF_JEQ_K, check_at - (len(program) + 1), 0, X86_64["clone"]))
    program.append((BPF_JEQ_K, enosys_at - (len(program) + 1), 0, X86_64["clone3"]))
    program.append((BPF_JEQ_K, socket_at - (len(program) + 1), 0, X86_64["socket"]))
    program.append((BPF_RET_K, 0, 0, RET_ALLOW))
    program.append((BPF_LD_W_ABS, 0, 0, OFFSET_ARG0))  # low 32 bits of the flags (little endian)
    program.append((BPF_JSET_K, deny_at - (len(program) + 1), 0, CLONE_NAMESPACES))
    program.append((BPF_RET_K, 0, 0, RET_ALLOW))
    program.append((BPF_LD_W_ABS, 0, 0, OFFSET_ARG0))  # the socket's address family
    program.append((BPF_JEQ_K, deny_at - (len(program) + 1), 0, AF_VSOCK))
    program.append((BPF_RET_K, 0, 0, RET_ALLOW))
    program.append((BPF_RET_K, 0, 0, RET_ERRNO | errno.EPERM))
    program.append((BPF_RET_K, 0, 0, RET_ERRNO | errno.ENOSYS))
    assert len(program) == enosys_at + 1 and max(jt for _, jt, _, _ in program) < 256
    return b"".join(struct.pack("<HBBI", *instruction) for instruction in program)
