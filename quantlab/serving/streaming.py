"""A load policy over an HTTP server that streams tokens (llama-server, vLLM).

One client thread per request in flight; each thread streams its request and
fills in its token times as the chunks reach the client. A rate that stops
early closes the open streams (the servers cancel what a closed connection
asked for). ``batch`` afterwards: requests in flight when a request's first
token came out (:func:`~quantlab.serving.requests.count_overlaps`).
"""
from __future__ import annotations

import abc
import http.client
import math
import socket
import threading
import time

from quantlab.serving.policies import Policy
from quantlab.serving.requests import Request, count_overlaps


class StreamingPolicy(Policy):
    """Subclasses say how one request streams (:meth:`stream_one`), how many
    sequences the server runs at once (``slots``) and how many forward steps
    it has run so far (:meth:`forwards`)."""

    slots: int

    @abc.abstractmethod
    def stream_one(self, r: Request, t0: float, conns: dict[int, http.client.HTTPConnection]) -> None:
        """Send ``r``, register its connection in ``conns[r.rid]``, and fill in
        ``r.tokens_s`` / ``r.tokens`` / ``r.start_s`` (seconds from ``t0``)
        as its tokens arrive. Raises ``RuntimeError`` when the server refuses."""

    @abc.abstractmethod
    def forwards(self) -> float:
        """The server's count of forward steps so far (for achieved bandwidth)."""

    def snapshot(self) -> object:
        """The server's own counters before a rate (None: it keeps none)."""
        return None

    def report(self, before: object, completed: int) -> dict[str, float]:
        """The server's own figures over the rate since ``snapshot``."""
        return {}

    def _one(self, r: Request, t0: float, conns: dict, ended: set, errors: list) -> None:
        try:
            self.stream_one(r, t0, conns)
        except RuntimeError as e:
            errors.append(str(e))
        except OSError:  # the connection was closed because the rate stopped
            pass
        finally:
            if r.rid in conns:
                conns[r.rid].close()
            ended.add(r.rid)

    def serve(self, requests, t0, last_due_s, limits, start) -> str:
        threads: list[threading.Thread] = []
        conns: dict[int, http.client.HTTPConnection] = {}
        ended: set[int] = set()
        errors: list[str] = []

        def submit(r: Request) -> None:
            th = threading.Thread(target=self._one, args=(r, t0, conns, ended, errors), daemon=True)
            threads.append(th)
            th.start()

        before, snap = self.forwards(), self.snapshot()
        start(submit)
        stopped = ""
        while not errors:
            left = len(requests) - len(ended)
            if not left:
                break
            in_flight = sum(1 for r in requests if not math.isnan(r.sent_s)) - len(ended)
            if stopped := limits.why_stop(time.perf_counter() - t0, in_flight - self.slots, left, last_due_s):
                break
            time.sleep(0.02)
        for conn in list(conns.values()):  # closing a stream makes the server cancel its request
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
        for th in threads:
            th.join(30)
        if errors:
            raise RuntimeError(errors[0])
        self.steps += int(self.forwards() - before)
        self.reported = self.report(snap, sum(1 for r in requests if r.done))
        count_overlaps(requests)
        return stopped
