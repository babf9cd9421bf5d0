"""``server.workers``: more than one process answering one port, so serving is not capped at one core.

Python runs one request's code at a time per process; past one core's worth of requests, more processes are the
way to more throughput. ``reef serve server.workers=N`` runs the usual process (the *primary*) plus ``N - 1``
*worker* processes (:mod:`reef_core.serve.process.worker`):

* All of them listen on the configured host and port (``SO_REUSEPORT``: the kernel spreads new connections over
  the processes).
* A worker is a serving replica (role ``serve``) on the same data directory and record store: it answers
  inference for the scenarios that exist, writing each record durably before the answer goes out, as the primary
  does. Everything else (reports, release operations, reads, the dashboard, ``/metrics``, a new scenario's first
  requests) it hands to the primary over a private Unix socket (:mod:`reef_core.serve.process.forward`).
* The primary runs the learners. Each worker has a channel to it (a socket pair inherited at spawn): the primary
  sends the configuration, then a line per head move (the worker serves the new release at once) and per deleted
  scenario (the worker stops serving it); the worker sends the scenarios it stored records for (the primary wakes
  their learners) and, every second while they change, its request and record-writer series (the primary's
  ``/metrics`` shows the sums). A worker's channel closing means its primary is gone: the worker shuts down. A
  worker that dies is started again.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

from reef_core.errors import ConfigError

log = logging.getLogger("reef.serve")

#: Upper bound on ``server.workers``: far beyond any core count this runs on, low enough to catch a typo.
MAX_WORKERS = 256
#: A worker that exits on its own is started again after this many seconds, doubling up to ``_RESTART_MAX_S``.
_RESTART_S = 0.5
_RESTART_MAX_S = 30.0


def check_workers(server_cfg) -> int:
    """``server.workers``, refused at start-up naming the key unless it is an integer from 1 to MAX_WORKERS."""
    workers = server_cfg.workers
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise ConfigError(f"server.workers must be an integer from 1 to {MAX_WORKERS} (processes serving the port), "
                          f"not {workers!r}")
    return workers


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` that other processes of this user may bind too (``SO_REUSEPORT``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def send_line(sock: socket.socket, lock: threading.Lock, message: dict) -> None:
    """One JSON line on a channel (either end); a closed channel is left for its reader to notice."""
    data = (json.dumps(message) + "\n").encode()
    try:
        with lock:
            sock.sendall(data)
    except OSError:
        pass


def worker_config(cfg, port: int):
    """A worker's configuration: the primary's, serving only, on the port the primary bound."""
    server = dataclasses.replace(cfg.server, learner=False, workers=1, port=port)
    return dataclasses.replace(cfg, server=server)


class _Worker:
    """One worker process and the primary's end of its channel."""

    def __init__(self, index: int, proc: subprocess.Popen, channel: socket.socket):
        self.index = index
        self.proc = proc
        self.channel = channel
        self.lock = threading.Lock()

    def send(self, message: dict) -> None:
        send_line(self.channel, self.lock, message)  # a worker gone is started again by its reader


class WorkerPool:
    """The primary's side: the sockets, the worker processes, their channels."""

    def __init__(self, cfg, deployment, metrics=None):
        from reef_core.serve.middleware.metrics import WorkerSeries

        self.cfg = cfg
        self.deployment = deployment
        #: What the workers counted (``/metrics`` on the primary shows the sums).
        self.series = WorkerSeries()
        if metrics is not None:
            metrics.workers = self.series
        self.count = check_workers(cfg.server) - 1
        self._dir = tempfile.mkdtemp(prefix="reef-workers-")  # short: a Unix socket path is at most ~107 bytes
        self.primary_path = os.path.join(self._dir, "primary.sock")
        self.port: int | None = None
        self._workers: dict[int, _Worker] = {}
        self._stopping = threading.Event()

    def bind(self) -> list[socket.socket]:
        """The public socket (the configured address) and the private one the workers hand requests to."""
        public = listening_socket(self.cfg.server.host, self.cfg.server.port)
        self.port = public.getsockname()[1]
        private = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        private.bind(self.primary_path)
        os.chmod(self.primary_path, 0o600)
        private.listen(2048)
        return [public, private]

    def start(self) -> None:
        """Start the workers (once the primary listens, so what they hand on finds it)."""
        self.deployment.tell_workers = self._tell
        for index in range(1, self.count + 1):
            self._spawn(index)

    def _spawn(self, index: int) -> None:
        worker = self._launch(index)
        threading.Thread(target=self._listen, args=(worker,), name=f"reef-worker-{index}", daemon=True).start()

    def _launch(self, index: int) -> _Worker:
        mine, theirs = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-m", "reef_core.serve.process.worker", str(theirs.fileno())],
                                pass_fds=[theirs.fileno()])
        theirs.close()
        worker = _Worker(index, proc, mine)
        config = base64.b64encode(pickle.dumps(worker_config(self.cfg, self.port))).decode()
        worker.send({"index": index, "primary": self.primary_path, "config": config})
        self._workers[index] = worker
        log.info("worker %d started (pid %d)", index, proc.pid)
        return worker

    def _listen(self, worker: _Worker) -> None:
        """What the worker says (scenarios with new records), until its channel closes; then start it again."""
        delay = _RESTART_S
        while True:
            started = time.monotonic()
            with worker.channel.makefile("rb") as lines:
                for line in lines:
                    try:
                        message = json.loads(line)
                    except ValueError:
                        continue
                    for scenario in message.get("stored", ()):
                        self.deployment.records_arrived(scenario)
                    if isinstance(message.get("metrics"), dict):
                        self.series.report(worker.index, message["metrics"])
            code = worker.proc.wait()
            worker.channel.close()
            self.series.retire(worker.index)
            if self._stopping.is_set():
                return
            # A worker that keeps dying right after its start is retried less and less often.
            delay = _RESTART_S if time.monotonic() - started > 60 else min(delay * 2, _RESTART_MAX_S)
            log.error("worker %d (pid %d) exited with %s; starting it again in %.1f s", worker.index,
                      worker.proc.pid, code, delay)
            if self._stopping.wait(delay):
                return
            worker = self._launch(worker.index)
            if self._stopping.is_set():  # stopped while it started: it exits as soon as it reads its config
                worker.channel.shutdown(socket.SHUT_WR)

    def _tell(self, message: dict) -> None:
        for worker in list(self._workers.values()):
            worker.send(message)

    def signal_stop(self) -> None:
        """Ask every worker to finish its requests and exit (its channel closes)."""
        self._stopping.set()
        for worker in list(self._workers.values()):
            try:
                worker.channel.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def wait(self, timeout: float) -> None:
        """Wait for the workers to exit (``timeout`` in all), then kill what is left; remove the socket's dir."""
        deadline = time.monotonic() + timeout
        for worker in list(self._workers.values()):
            try:
                worker.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %d did not stop within %.0f s; killing it", worker.index, timeout)
                worker.proc.kill()
                worker.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
