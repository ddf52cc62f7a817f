"""A loopback TCP proxy that injects network faults between robot agents and one service.

    robot agent ──► FaultProxy (127.0.0.1:P) ──► service (127.0.0.1:S)
      pass   bytes are forwarded both ways, as they come
      drop   every open connection is closed and every new one is closed on accept: nothing is
             forwarded (the robot sees "server disconnected" and retries)
      delay  every chunk waits ``delay_s`` before it is forwarded, both ways (latency; past the
             robot's timeouts a request fails)
      reset  (an instant, not a mode) every open connection is aborted with a TCP RST

Robots reach it through ``runtime.robot_inference_url`` / ``robot_ingest_url``; the services do
not know it exists. The product needs no proxy: this is the chaos run's network, kept beside the
runtime because the chaos run (``chaos.py``) and its tests drive it. It runs an asyncio loop on
its own daemon thread, so the process that holds it (the chaos runner) is free to do the rest.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

PASS, DROP, DELAY = "pass", "drop", "delay"
MODES = (PASS, DROP, DELAY)
CHUNK_BYTES = 64 * 1024
START_TIMEOUT_S = 10.0
RST_LINGER = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST instead of FIN


@dataclass
class ProxyStats:
    connections: int = 0  # accepted
    dropped: int = 0  # closed by a drop (open ones and ones accepted during it)
    reset: int = 0  # aborted with RST
    delayed_chunks: int = 0


class _Link:
    """One proxied connection: the robot's side and the service's side."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.client, self.upstream = client, upstream

    def close(self, rst: bool = False) -> None:
        for writer in (self.client, self.upstream):
            if rst:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST_LINGER)
                    except OSError:
                        pass
                writer.transport.abort()
            else:
                writer.close()


class FaultProxy:
    """Forwards ``listen_host:port`` (a free port, chosen at start) to ``target_host:target_port``."""

    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1") -> None:
        self.target_host, self.target_port, self.listen_host = target_host, target_port, listen_host
        self.mode = PASS
        self.delay_s = 0.0
        self.port = 0
        self.stats = ProxyStats()
        self._links: set[_Link] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._run, name=f"fault-proxy-{target_port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.listen_host}:{self.port}"

    @property
    def open_connections(self) -> int:
        return len(self._links)

    def start(self) -> FaultProxy:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or not self.port:
            raise RuntimeError(f"fault proxy for port {self.target_port} did not start")
        return self

    def set_mode(self, mode: str, delay_s: float = 0.0) -> None:
        """Switch to ``pass`` / ``drop`` / ``delay`` (a drop also closes every open connection)."""
        if mode not in MODES:
            raise ValueError(f"unknown proxy mode {mode!r}; use one of {MODES}")
        self._call(self._apply, mode, delay_s)

    def reset(self) -> None:
        """Abort every open connection with a TCP RST (the mode stays as it is)."""
        self._call(self._close_all, True)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=START_TIMEOUT_S)

    # ------------------------------------------------------------------ on the proxy's loop
    def _call(self, fn, *args) -> None:
        done = threading.Event()

        def run() -> None:
            try:
                fn(*args)
            finally:
                done.set()

        self._loop.call_soon_threadsafe(run)
        done.wait(START_TIMEOUT_S)

    def _apply(self, mode: str, delay_s: float) -> None:
        self.mode, self.delay_s = mode, delay_s
        if mode == DROP:
            self._close_all(False)

    def _close_all(self, rst: bool) -> None:
        for link in list(self._links):
            link.close(rst=rst)
            if rst:
                self.stats.reset += 1
            else:
                self.stats.dropped += 1
        self._links.clear()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, self.listen_host, 0))
            self.port = int(self._server.sockets[0].getsockname()[1])
        finally:
            self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._close_all(False)
            self._server.close()
            self._loop.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        if self.mode == DROP:
            self.stats.dropped += 1
            client_w.close()
            return
        try:
            upstream_r, upstream_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:  # the service is down: the robot sees its connection closed, as without a proxy
            client_w.close()
            return
        link = _Link(client_w, upstream_w)
        self._links.add(link)
        pipes = [asyncio.create_task(self._pipe(client_r, upstream_w)), asyncio.create_task(self._pipe(upstream_r, client_w))]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pipes:
                task.cancel()
            if link in self._links:
                self._links.discard(link)
                link.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(CHUNK_BYTES):
                if self.mode == DELAY and self.delay_s > 0:
                    self.stats.delayed_chunks += 1
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
