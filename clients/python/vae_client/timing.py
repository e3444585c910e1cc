"""What a call saw: the server's ``Server-Timing`` phases, request id, attempts, waits."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CallInfo:
    """The last successful call: Server-Timing phases (ms), request id, attempts, status,
    wall seconds, response headers, and the seconds slept before each retry."""

    timings: dict[str, float] = field(default_factory=dict)
    request_id: str = ""
    attempts: int = 0
    status: int = 0
    seconds: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    waits: list[float] = field(default_factory=list)


def parse_server_timing(header: str | None) -> dict[str, float]:
    """``a;dur=1.2, b;desc="x";dur=3`` -> ``{"a": 1.2, "b": 3.0}`` (milliseconds)."""
    out: dict[str, float] = {}
    for entry in (header or "").split(","):
        name, *attrs = [p.strip() for p in entry.split(";")]
        if not name:
            continue
        for attr in attrs:
            key, _, value = attr.partition("=")
            if key.strip().lower() == "dur":
                try:
                    out[name] = out.get(name, 0.0) + float(value.strip('"'))
                except ValueError:
                    pass
    return out
