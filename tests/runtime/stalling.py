"""A hostile HTTP/2 peer for tests: opens gRPC streams that send the headers (with a valid token) and part of a
request message, then stall -- what no grpc client library lets a test do. Raw frames on a socket bound to any
loopback address (``127.0.0.2`` is another client than ``127.0.0.1`` to the server)."""

from __future__ import annotations

import socket
import struct
import threading
import time

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _SETTINGS, _PING = 0x0, 0x1, 0x4, 0x6
_END_HEADERS, _ACK = 0x4, 0x1


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """HPACK "literal header field without indexing, new name" (lengths below 127, no Huffman)."""
    n, v = name.encode(), value.encode()
    assert len(n) < 127 and len(v) < 127
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def _request_headers(address: str, path: str, token: str) -> bytes:
    """The HEADERS block of a gRPC call of ``path`` with the job token."""
    return b"".join(_literal(k, v) for k, v in [
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", address),
        ("content-type", "application/grpc"), ("te", "trailers"), ("x-kubeps-job-token", token)])


def _split_frames(buf: bytes) -> tuple[list[tuple[int, int, int, bytes]], bytes]:
    """The whole frames at the start of ``buf`` as ``(kind, flags, stream, payload)``, and the bytes left over."""
    frames = []
    while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
        length = int.from_bytes(buf[:3], "big")
        frames.append((buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF, buf[9 : 9 + length]))
        buf = buf[9 + length :]
    return frames, buf


class StallingPeer:
    """``streams`` stalled calls of ``path`` over ``connections`` TCP connections from ``source``."""

    def __init__(self, address: str, path: str, token: str, *, streams: int, connections: int = 1,
                 source: str = "127.0.0.2", sent_bytes: int = 10):
        host, port = address.rsplit(":", 1)
        self.sockets: list[socket.socket] = []
        self._stop = threading.Event()
        headers = _request_headers(address, path, token)
        # a gRPC message prefix announcing 1 MB, then only the first bytes of it
        partial = b"\x00" + struct.pack(">I", 1 << 20) + b"KPS1"[:sent_bytes] + b"\0" * max(0, sent_bytes - 4)
        per = [streams // connections + (1 if i < streams % connections else 0) for i in range(connections)]
        for count in per:
            sock = socket.create_connection((host, int(port)), source_address=(source, 0))
            sock.sendall(_PREFACE + _frame(_SETTINGS, 0, 0))
            threading.Thread(target=self._answer, args=(sock,), daemon=True).start()
            for i in range(count):
                stream = 2 * i + 1
                sock.sendall(_frame(_HEADERS, _END_HEADERS, stream, headers) + _frame(_DATA, 0, stream, partial))
            self.sockets.append(sock)

    def _answer(self, sock: socket.socket) -> None:
        """ACK the server's SETTINGS and PINGs (a silent peer would be dropped for that, not for stalling)."""
        buf = b""
        try:
            while not self._stop.is_set():
                data = sock.recv(65536)
                if not data:
                    return
                frames, buf = _split_frames(buf + data)
                for kind, flags, _, payload in frames:
                    if kind == _SETTINGS and not flags & _ACK:
                        sock.sendall(_frame(_SETTINGS, _ACK, 0))
                    elif kind == _PING and not flags & _ACK:
                        sock.sendall(_frame(_PING, _ACK, 0, payload))
        except OSError:
            return

    def close(self) -> None:
        self._stop.set()
        for sock in self.sockets:
            try:
                sock.close()
            except OSError:
                pass


def answered_before_end_of_stream(address: str, path: str, token: str, message: bytes, wait_s: float) -> bool:
    """Send one whole gRPC request ``message`` on ``path`` without ending the stream (no END_STREAM flag, as a
    client that keeps its request side open would); whether the server sends an answer message within ``wait_s``."""
    host, port = address.rsplit(":", 1)
    headers = _request_headers(address, path, token)
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(_PREFACE + _frame(_SETTINGS, 0, 0) + _frame(_HEADERS, _END_HEADERS, 1, headers)
                     + _frame(_DATA, 0, 1, b"\x00" + struct.pack(">I", len(message)) + message))
        buf, deadline = b"", time.monotonic() + wait_s
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = sock.recv(65536)
            except TimeoutError:
                return False
            if not data:
                return False
            frames, buf = _split_frames(buf + data)
            for kind, flags, stream, payload in frames:
                if kind == _SETTINGS and not flags & _ACK:
                    sock.sendall(_frame(_SETTINGS, _ACK, 0))
                elif kind == _DATA and stream == 1 and payload:
                    return True
    return False
