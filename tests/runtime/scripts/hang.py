"""One process fed to a HangWatchdog; argv[1] picks the behaviour, argv[2] the timeout in seconds.

idle: never beats (the watchdog is never armed) and exits 0 after a while.
steady: beats every 20 ms for a while and exits 0.
stuck: completes steps 1..3, then waits forever in ``stuck_here``.
gil: completes steps 1..3, then sleeps in C while holding the GIL (only the backstop can fire).
"""

import ctypes
import sys
import threading
import time

from vertexrt.runtime.watchdog import HangWatchdog


def stuck_here() -> None:
    threading.Event().wait()


def main() -> None:
    mode, timeout = sys.argv[1], float(sys.argv[2])
    watchdog = HangWatchdog(timeout, replica="workerpool0-0 rank 0").start()
    if mode == "idle":
        time.sleep(6 * timeout)
    elif mode == "steady":
        deadline = time.monotonic() + 6 * timeout
        step = 0
        while time.monotonic() < deadline:
            step += 1
            time.sleep(0.02)
            watchdog.beat(step)
    else:
        for step in range(1, 4):
            time.sleep(timeout / 4)  # a step's work, during which the watchdog thread looks
            watchdog.beat(step)
        print("READY", flush=True)
        if mode == "gil":
            ctypes.PyDLL(None).sleep(120)  # PyDLL keeps the GIL during the call
        else:
            stuck_here()
    watchdog.stop()
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main()
