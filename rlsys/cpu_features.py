"""What this machine's CPU computes in hardware, where torch does not say.

torch reports its kernels' instruction set (`torch.backends.cpu.get_cpu_capability()`: "AVX512"), not whether the
CPU multiplies bfloat16 itself. Without that (an AVX2 or a plain AVX-512 CPU) oneDNN emulates bf16 matmuls, slower
than float32; with it they beat float32's (BENCHMARKS.md, "A bfloat16 learner on a CPU").
"""

import functools
import platform
from pathlib import Path

# /proc/cpuinfo's flags for bf16 arithmetic: x86's AVX512-BF16 and AMX, Arm's BF16 extension
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


@functools.cache
def native_bf16() -> bool:
    """Whether the CPU computes bfloat16 dot products itself (Linux; elsewhere False: not known)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return has_bf16_flag(cpuinfo, platform.machine())


def has_bf16_flag(cpuinfo: str, machine: str) -> bool:
    """From /proc/cpuinfo's text: its first processor's "flags" (x86) or "Features" (Arm) line."""
    key = "features" if machine.lower() in ("aarch64", "arm64") else "flags"
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() == key:
            return bool(BF16_FLAGS & set(value.split()))
    return False
