"""Run at the start of every Python process of vLLM's server (its
``PYTHONPATH`` names this directory on hosts with AMX): ask Linux for
permission to use AMX tile data (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``), which a process must request before its first AMX
instruction. vLLM 0.32's CPU int8/int4 kernels use AMX without asking, so on
an AMX Xeon their worker died with SIGILL at the first request; spawned
workers inherit the environment, hence a ``sitecustomize`` rather than a
flag of the server command. vLLM's venv has no quantlab: standard library only.
"""
import ctypes
import platform

if platform.system() == "Linux" and platform.machine() == "x86_64":
    ctypes.CDLL(None).syscall(158, 0x1023, 18)  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
