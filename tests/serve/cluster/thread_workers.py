"""Scripted engines served in threads: the worker loop and heartbeats of real workers,
without their processes (test_failover.py, test_crash_isolation.py)."""

import threading

import zmq

from deepwell.serve.messages import Shutdown, encode_message
from deepwell.serve.worker import send_heartbeats, serve_engine


class ThreadWorkers:
    """Scripted workers in threads, each with its heartbeat thread (which `silence` stops,
    as does an engine's own `on_death`, where it has one)."""

    def __init__(self, tmp_path, engines):
        self.context = zmq.Context()
        self.outbox = f"ipc://{tmp_path}/out"
        self.inboxes = [f"ipc://{tmp_path}/in-{i}" for i in range(len(engines))]
        self.engines = engines
        self.stops = []
        self.threads = []
        self.sockets = []
        for worker_id, (engine, address) in enumerate(zip(engines, self.inboxes, strict=True)):
            inbox = self.context.socket(zmq.PULL)
            inbox.bind(address)
            outbox = self.context.socket(zmq.PUSH)
            outbox.connect(self.outbox)
            self.sockets += [inbox, outbox]
            stop = threading.Event()
            if hasattr(engine, "on_death"):
                engine.on_death = stop.set
            self.stops.append(stop)
            self.threads.append(
                threading.Thread(target=serve_engine, args=(engine, worker_id, inbox, outbox))
            )
            self.threads.append(
                threading.Thread(
                    target=send_heartbeats, args=(self.context, self.outbox, worker_id, stop)
                )
            )
        for thread in self.threads:
            thread.start()

    def silence(self, worker_id):
        self.stops[worker_id].set()

    def close(self):
        for stop in self.stops:
            stop.set()
        sender = self.context.socket(zmq.PUSH)
        for address in self.inboxes:
            sender.connect(address)
        for _ in self.inboxes:
            sender.send(encode_message(Shutdown()))
        for thread in self.threads:
            thread.join(timeout=5)
        sender.close(linger=0)
        for socket in self.sockets:
            socket.close(linger=0)
        self.context.term()
