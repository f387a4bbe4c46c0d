"""How pdserve's servers (`serve`, the router, the KV store) take the signals that stop them.

- SIGTERM or Ctrl-C (SIGINT) starts a graceful stop: no new connections, the requests in flight get their
  drain, then the process exits.
- A second signal within SAME_STOP_S of the first is the same stop: a terminal sends Ctrl-C to every
  process of its foreground group, systemd sends SIGTERM to every process of a service at once, and a
  launcher may forward the signal as well. A later one stops the process at once, without the drain.
- A child of a launcher that stops its children itself (`pdserve up`, `pdserve bench compare`: their
  ChildProcesses sets IGNORE_SIGINT_ENV) ignores SIGINT: the terminal's Ctrl-C reaches it too, and its
  launcher then sends it one SIGTERM, so that the drain is not cut short by a second signal.
- `serve` and `up` take Ctrl-C from their start, also when started with SIGINT ignored (a background job of
  a script, a test runner's child), unless their launcher owns it (claim_sigint).
The engine process and tensor-parallel ranks take none of these: their server stops them.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Callable

IGNORE_SIGINT_ENV = "PDSERVE_IGNORE_SIGINT"
SAME_STOP_S = 1.0


def claim_sigint() -> None:
    """Take Ctrl-C (KeyboardInterrupt) from the start, also when this process started with SIGINT ignored
    (`pdserve serve &` from a script, or under a test runner), unless its launcher owns Ctrl-C."""
    if os.environ.get(IGNORE_SIGINT_ENV) != "1":
        signal.signal(signal.SIGINT, signal.default_int_handler)


def stop_signals() -> tuple[int, ...]:
    """The signals that stop this server (SIGINT ignored from now on when a launcher owns Ctrl-C)."""
    if os.environ.get(IGNORE_SIGINT_ENV) == "1":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return (signal.SIGTERM,)
    return (signal.SIGINT, signal.SIGTERM)


def stop_handler(start_stop: Callable[[], None], exit_now: Callable[[], None] = lambda: os._exit(1)
                 ) -> Callable[[], None]:
    """A signal callback: the first signal calls start_stop, one within SAME_STOP_S of it nothing, a later
    one exit_now."""
    first: list[float] = []

    def on_signal() -> None:
        now = time.monotonic()
        if not first:
            first.append(now)
            start_stop()
        elif now - first[0] > SAME_STOP_S:
            exit_now()
    return on_signal
