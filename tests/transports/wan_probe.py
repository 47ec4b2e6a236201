"""TCP probes run inside a WAN namespace: `server PORT` (echo + sink) and `rtt|rate HOST PORT`."""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time


def server(port: int) -> None:
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", port))
    ls.listen()
    print("LISTENING", flush=True)
    import threading

    while True:
        conn, _ = ls.accept()
        threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def _handle(conn: socket.socket) -> None:
    if True:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = conn.recv(1)
        if mode == b"e":  # echo one byte at a time
            while (b := conn.recv(1)):
                conn.sendall(b)
        else:  # sink: count bytes per time window, report after the sender closes
            buf, got, t0, marks = bytearray(1 << 20), 0, time.monotonic(), []
            while (n := conn.recv_into(buf)):
                got += n
                marks.append((time.monotonic() - t0, got))
            conn.sendall(json.dumps(marks[:: max(1, len(marks) // 2000)] + marks[-1:]).encode())
        conn.close()


def rtt(host: str, port: int, n: int = 30) -> float:
    s = socket.create_connection((host, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(b"e")
    samples = []
    for _ in range(n):
        t = time.monotonic()
        s.sendall(b"x")
        s.recv(1)
        samples.append(time.monotonic() - t)
    return statistics.median(samples[3:])


def rate(host: str, port: int, duration: float = 4.0, streams: int = 4) -> float:
    """Aggregate goodput (bit/s) in the steady window [1.5 s, duration] over several TCP streams."""
    socks = [socket.create_connection((host, port)) for _ in range(streams)]
    for s in socks:
        s.sendall(b"s")
        s.setblocking(False)
    chunk, end = b"\0" * (1 << 20), time.monotonic() + duration
    import select

    while time.monotonic() < end:
        _, writable, _ = select.select([], socks, [], 0.1)
        for s in writable:
            try:
                s.send(chunk)
            except BlockingIOError:
                pass
    total = 0.0
    for s in socks:
        s.setblocking(True)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while (b := s.recv(1 << 16)):
            data += b
        marks = json.loads(data)
        lo = next(m for m in marks if m[0] >= 1.5)
        hi = [m for m in marks if m[0] <= duration - 0.1][-1]
        total += (hi[1] - lo[1]) * 8 / (hi[0] - lo[0])
    return total


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(int(sys.argv[2]))
    else:
        fn = rtt if sys.argv[1] == "rtt" else rate
        print(json.dumps(fn(sys.argv[2], int(sys.argv[3]))))
