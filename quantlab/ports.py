"""Whether a server could listen on a local port now, and if not, why:
checked before quantlab starts one (a tracking server, a vLLM server), so a
port another process holds is one line naming that process, not a server
that starts, fails to bind and exits; and whether one answers at a host and
port (a database a store names)."""
from __future__ import annotations

import contextlib
import errno
import socket

import psutil


def unavailable(host: str, port: int) -> str:
    """'' when ``host:port`` can be bound now (as servers bind: with
    ``SO_REUSEADDR``, so a socket in TIME_WAIT does not count); else why not,
    to follow "port N": ``is in use by pid P (command)``, ``is in use by
    another process`` where the holder cannot be found, or ``cannot be bound
    (<error>)``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return ""
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return f"cannot be bound ({e.strerror})"
    return f"is in use by {_listener(port)}"


def _listener(port: int) -> str:
    """The process listening on ``port``, as a message names it."""
    with contextlib.suppress(psutil.Error, OSError):  # another user's process, or no right to list sockets
        for c in psutil.net_connections(kind="inet"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                p = psutil.Process(c.pid)
                return f"pid {c.pid} ({' '.join(p.cmdline())[:120] or p.name()})"
    return "another process"


def connect_error(host: str, port: int, timeout_s: float) -> str:
    """'' when something accepts a TCP connection at ``host:port`` within
    ``timeout_s``, else why not (the socket error's words)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        return e.strerror or type(e).__name__
    return ""
