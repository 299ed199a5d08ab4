"""Heartbeats: every service node answers `node.heartbeat` with a stream of status items, one every `interval` seconds, for
as long as the caller listens, and `node.status` with one such item now. The router keeps one stream open per node
(Watch); a node whose next item is late by more than `timeout` seconds, or whose connection drops, is down, and the watch
keeps dialling until it answers again, when it rejoins. A status item: {"role", "node", "time", ...what the node's status
function adds (free KV blocks, queued prefill tokens, ...)}.
"""
from __future__ import annotations
import threading, time
from tinyhet.runtime.control import ControlClient

INTERVAL_S = 0.5     # a node's beat
TIMEOUT_S = 3.0      # silence after which the router calls it down: a few beats, so one slow reply (a busy GIL) is no false alarm

def install(endpoint, role: str, status, per_stream=None) -> None:
  """Serve node.heartbeat on endpoint: status() -> dict is called for each beat; per_stream() makes, for each stream, a
  callable whose dict joins each of its beats (what a stream says relative to its own beat before)."""
  def serve(conn, interval: float = INTERVAL_S):
    if not isinstance(interval, (int, float)) or not 0.01 <= interval <= 10: raise ValueError(f"interval must be 0.01..10 s, got {interval!r}")
    mine = per_stream() if per_stream is not None else dict
    while True:       # ends when the caller goes away (the send fails)
      yield {"role": role, "node": endpoint.name, "time": time.time(), **status(), **mine()}
      time.sleep(interval)
  endpoint.handle("node.heartbeat", serve)
  # one beat now, without a stream's summaries: the router asks when it knows the figures changed since the last beat (a
  # request of its own there ended), rather than wait for the next one
  endpoint.handle("node.status", lambda conn: {"role": role, "node": endpoint.name, "time": time.time(), **status()})

class Watch:
  """One node's liveness, seen from the router: a thread that holds a heartbeat stream open, calls on_beat(status) for every
  beat and on_down(reason) when the stream fails or falls silent, then dials again until the node answers."""
  def __init__(self, endpoint, address: str, on_beat, on_down, interval: float = INTERVAL_S, timeout: float = TIMEOUT_S):
    self.endpoint, self.address, self.on_beat, self.on_down = endpoint, address, on_beat, on_down
    self.interval, self.timeout = interval, timeout
    self.stopped = threading.Event()
    self.ctl: ControlClient | None = None
    self.thread = threading.Thread(target=self._run, name=f"tinyhet-heartbeat-{address}", daemon=True)
    self.thread.start()

  def _run(self):
    while not self.stopped.is_set():
      error = None
      try:
        self.ctl = ControlClient(self.endpoint, self.address)
        for beat in self.ctl.stream("node.heartbeat", reply_timeout=self.timeout, interval=self.interval):
          if self.stopped.is_set(): break
          self.on_beat(beat)
      except Exception as e: error = e
      finally:
        if self.ctl is not None: self.ctl.close()
      if self.stopped.is_set(): return
      self.on_down(f"{type(error).__name__}: {error}" if error else "heartbeat stream ended")
      self.stopped.wait(self.interval)

  def close(self):
    self.stopped.set()
    if self.ctl is not None: self.ctl.close()
    self.thread.join(timeout=5)
