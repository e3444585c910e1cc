"""``python -m tests.healthz_probe URL``: GET URL/healthz every 0.2 s until stdin closes, then
print each answer's seconds on one line.

Its own process, so that what it measures is the server: a probe from a test process that
runs 32 client threads waits on their GIL too, and that wait grows with the machine's load."""

from __future__ import annotations

import sys
import threading
import time
import urllib.request


def main(url: str) -> None:
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    seconds = []
    while not stop.is_set():
        start = time.perf_counter()
        with urllib.request.urlopen(f"{url}/healthz", timeout=30) as answer:
            answer.read()
        seconds.append(time.perf_counter() - start)
        stop.wait(0.2)
    print(" ".join(f"{s:.4f}" for s in seconds))


if __name__ == "__main__":
    main(sys.argv[1])
