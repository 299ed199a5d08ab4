"""Seconds a decode step of R rows takes on this node, measured, for speculative decoding's cost model (spec_policy.py).

  costs = StepCosts(engine)
  t = costs(rows)                      # seconds of a step at rows' batch bucket
  costs.record(rows, seconds)          # a real step's time (plain or verify), folded into its bucket's estimate

A step runs at its batch bucket (decode_engine.batch_bucket), so the cost is the bucket's. Nothing is hard-coded: a bucket
never timed is measured the first time it is asked for, by the engine's own step of that many padding rows (captured first
if it is not: TinyJit runs, captures, then replays; the timed runs are replays), the least of a few. Padding rows attend to
one slot, so that first figure leaves out attention over real context; the steps the node then runs replace it: the
figure is the least of the bucket's last `window` steps (padding-row runs and real ones), so a bucket the policy uses
follows what it costs at the batch's context as that grows, and a step slowed by other work on the node's cores (a
delay, never a speed-up) does not make its bucket look dearer than its neighbours until a quiet step comes.

StepCosts(engine, capture=False) (the decode node's): where the model has a warm-up (engine/warm_up.py, the node's
captures, built at start), a bucket with no capture yet costs infinity, so no step is planned there and nothing is
captured on a request's path: speculation drafts at the buckets the warm-up has built so far (up to the node's batch once
it is over), and a verify step larger than those is not drafted. With no warm-up (`warm_up = off`: every shape is
captured on first use) a bucket is captured when first priced, as with capture=True.
"""
from __future__ import annotations
import time
from collections import deque
from tinyhet.engine.decode_engine import PAD_SEQ, batch_bucket

class StepCosts:
  def __init__(self, engine, window: int = 8, lock=None, capture: bool = True):
    self.engine, self.window, self.lock, self.capture = engine, window, lock, capture
    self.seconds: dict[int, float] = {}      # bucket -> estimated seconds of one step (the least of its recent ones)
    self.recent: dict[int, deque] = {}       # bucket -> its last `window` step times
    self.measured = 0                        # buckets measured with padding rows (not real steps)

  def __call__(self, rows: int) -> float:
    B = batch_bucket(rows)
    if B not in self.seconds:
      if not self.capture and getattr(self.engine.model, "warm", None) is not None and not self.captured(B): return float("inf")
      self.seconds[B] = self.measure(B)
    return self.seconds[B]

  def captured(self, B: int) -> bool:
    """Whether the engine's step at bucket B is captured (replays without tinygrad scheduling or compiling)."""
    step = self.engine.steps.get(B)
    return step is not None and (getattr(step, "jit", None) is None or step.jit.captured is not None)

  def record(self, rows: int, seconds: float):
    B = batch_bucket(rows)
    recent = self.recent.setdefault(B, deque(maxlen=self.window))
    recent.append(seconds)
    self.seconds[B] = min(recent)

  def measure(self, B: int, runs: int = 3) -> float:
    """The least of `runs` timed replays of a step of B padding rows (the bucket captured first if it is not)."""
    self.measured += 1
    if not self.captured(B): self.engine.warm_up([B], self.lock)
    for _ in range(runs):
      t0 = time.perf_counter()
      self.engine.step([PAD_SEQ] * B, [0] * B, self.lock, bucket=B)
      self.record(B, time.perf_counter() - t0)
    return self.seconds[B]
