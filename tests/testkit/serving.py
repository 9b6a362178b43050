"""Helpers for tests against a running `kvexport serve`."""

from __future__ import annotations

import threading
import time

import httpx


def health_while(client: httpx.Client, base: str, threads: list[threading.Thread]) -> list[float]:
    """/health latencies (s), one request after another, until every thread has finished; each must be a 200."""
    lat = []
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        assert client.get(f"{base}/health").status_code == 200
        lat.append(time.monotonic() - t0)
    for t in threads:
        t.join()
    return lat
