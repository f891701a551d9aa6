"""Killing a launched engine server while it holds requests (the fault-tolerance tests' rollouts)."""

from __future__ import annotations

import os
import signal
import threading
import time


def kill_when_busy(
    engines, index: int, seen: dict, timeout: float = 60.0, sig: int = signal.SIGKILL
) -> threading.Thread:
    """Start a thread that SIGKILLs engine `index`'s process (or sends it `sig`: SIGSTOP makes a hung engine) once
    its client has a request in flight (or after `timeout` s); it records `in_flight_at_kill` and `killed_pid` in
    `seen`. Join it after the rollout. Engines a Ray runtime started (lichen.cluster.engine_actors: the server is
    a child of its actor, on this host in the tests) are signalled by the pid their actor reports."""
    launcher = engines.launcher
    if hasattr(launcher, "servers"):
        pid = launcher.servers[index].proc.pid
    else:
        import ray

        pid = ray.get(launcher.actors[index].server_pid.remote())

    def kill() -> None:
        end = time.monotonic() + timeout
        while engines.clients[index].in_flight == 0 and time.monotonic() < end:
            time.sleep(0.0005)
        seen["in_flight_at_kill"] = engines.clients[index].in_flight
        seen["killed_pid"] = pid
        os.kill(pid, sig)

    killer = threading.Thread(target=kill)
    killer.start()
    return killer
