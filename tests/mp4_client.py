"""A raw-socket MP4 client and the ffmpeg children of this process: what the stream tests
(tests/test_streams.py) and ``bench/stream_ends.py`` read streams with (the reader's receive
buffer and pace are the caller's to set)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch


def video_latent(tag: float, frames: int, size: int, command: float = 0.0, arg: float = 0.0):
    """Noise (so the MP4 is large enough to fill the socket buffers) carrying a command."""
    z = torch.randn(1, 4, frames, size, size, generator=torch.Generator().manual_seed(int(tag)))
    z.view(1, 4, -1)[0, :3, 0] = torch.tensor([command, arg, tag])
    return z


class RawStream:
    """One MP4 request on a raw socket with a small receive buffer: the test reads it at
    its own pace, or not at all."""

    def __init__(self, url: str, z: torch.Tensor, request_id: str = "", rcvbuf: int = 2048):
        host, port = urlsplit(url).hostname, urlsplit(url).port
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.connect((host, port))
        body = z.numpy().tobytes()
        query = f"shape={','.join(map(str, z.shape))}&dtype=float32&output_type=mp4"
        head = (
            f"POST /decode/faulty-video?{query} HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: tensor/binary\r\nContent-Length: {len(body)}\r\n"
            f"X-Request-Id: {request_id or 'none'}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + body)
        self.raw = b""

    def read(self, n: int, timeout: float = 30) -> bytes:
        """Up to n bytes, b"" at the end of the connection."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(n)
        except ConnectionResetError:
            data = b""
        self.raw += data
        return data

    def read_head(self) -> tuple[int, dict[str, str]]:
        while b"\r\n\r\n" not in self.raw:
            if not self.read(1024):
                raise AssertionError(f"no response head: {self.raw!r}")
        head = self.raw.split(b"\r\n\r\n", 1)[0].decode()
        lines = head.split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        return int(lines[0].split()[1]), headers

    def read_paced(self, rate: int) -> None:
        """Read to the end of the connection, ``rate`` bytes a second in tenth-second steps."""
        step = max(1, rate // 10)
        while self.read(step):
            time.sleep(0.1)

    def body(self) -> tuple[bytes, bool]:
        """The de-chunked body, and whether its terminating chunk came (a complete body)."""
        rest, out = self.raw.split(b"\r\n\r\n", 1)[1], b""
        while b"\r\n" in rest:
            size_line, rest = rest.split(b"\r\n", 1)
            size = int(size_line, 16)
            if size == 0:
                return out, True
            if len(rest) < size + 2:
                return out + rest[:size], False
            out, rest = out + rest[:size], rest[size + 2 :]
        return out, False

    def close(self) -> None:
        self.sock.close()


def ffmpeg_children() -> list[int]:
    """Pids of this process's ffmpeg children (the in-process server's encoders), zombies
    included: a reaped child is gone from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        if comm.startswith("ffmpeg") and int(fields.split()[1]) == os.getpid():
            pids.append(int(entry.name))
    return pids
