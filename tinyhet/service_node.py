"""What a node process adds for the cluster service (`tinyhet serve`): heartbeats, `decode.submit`, and the prefill and
`both` roles of `tinyhet node`.

  decode.submit  prompt ids, max_new_tokens, sampling options -> the decode node prefills the prompt itself (its batching
                 loop's recompute path, on MESH) and streams every token, the first included. The router uses it for a
                 prompt short enough to prefill where it is decoded, for a `both` node's own requests, and when no prefill
                 node is left.
  --role prefill the model on HET and a PrefillNode (tinyhet.prefill_node) answering prefill.run.
  --role both    a decode node and a PrefillNode over one copy of the model on MESH: prefill jobs run on the batching
                 loop's thread between its steps, and the router gives the node prefill or decode work from the queue
                 lengths and free KV blocks its heartbeats report.
"""
from __future__ import annotations
import json, queue, signal, sys, threading
from tinyhet import heartbeat

def install_submit(decode) -> None:
  from tinyhet.decode_node import MAX_SEQ_ID
  from tinyhet.sampling import Sampler
  from tinyhet.scheduler import Sequence

  def serve_submit(conn, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                   stop_ids: list[int] | None = None):
    cfg = decode.model.cfg
    if not isinstance(prompt_ids, list) or not prompt_ids or not all(isinstance(t, int) and 0 <= t < cfg.vocab_size for t in prompt_ids):
      raise ValueError(f"prompt_ids must be a non-empty list of token ids below {cfg.vocab_size}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if len(prompt_ids) + max_new_tokens > cfg.max_context:
      raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the model's context ({cfg.max_context})")
    seq = Sequence(next(decode.seq_ids) % MAX_SEQ_ID, list(prompt_ids), max_new_tokens)
    seq.extra.update(queue=queue.SimpleQueue(), sampler=Sampler(float(temperature), float(top_p), seed), want_logits=False,
                     stop_ids=set(stop_ids if stop_ids is not None else decode.stop_ids))
    with decode.cond:
      decode.scheduler.add(seq)            # the batching loop prefills it when its blocks fit (first come, first served)
      decode.cond.notify_all()
    decode._attach(conn, seq)              # the connection closing drops it
    return stream_submitted(decode, conn, seq)

  decode.node.endpoint.handle("decode.submit", serve_submit)

def stream_submitted(decode, conn, seq):
  """Every token of a submitted sequence, as the batching loop samples it. It yields None while it waits (the control
  channel then checks for a cancel or a departed client); however it ends, the sequence leaves the node."""
  from tinyhet.decode_node import queued_tokens
  try:
    for tok in queued_tokens(seq): yield None if tok is None else {"token": tok}
    yield {"done": True, "preemptions": seq.num_preemptions}
  finally: decode._detach(conn.state.get("seqs", {}), seq)

def decode_status(decode) -> dict:
  # read without decode.cond: a `both` node's batching loop can hold it while it waits for the model (a long prefill), and a
  # heartbeat must not wait that long; a count a moment stale is what a heartbeat is anyway
  bm, s = decode.cache.block_manager, decode.scheduler
  return {"model": decode.model_id, "kv_blocks": s.capacity, "free_blocks": bm.num_free, "block_size": decode.cache.block_size,
          "running": len(s.running), "waiting": len(s.waiting), "incoming": len(s.incoming), "max_seqs": s.max_num_seqs,
          "max_context": decode.model.cfg.max_context}

class ServiceExtras:
  """Heartbeats and decode.submit on a decode node; with role `both`, a PrefillNode sharing its model, on its own thread."""
  def __init__(self, decode, role: str):
    from tinyhet.prefill_node import PrefillNode
    install_submit(decode)
    self.prefill = None
    if role == "both":
      # tinygrad may be used from one thread only (its compile cache is a sqlite connection bound to the thread that opened
      # it, and its scheduler flips process-wide flags while it works), so prefill jobs run on the batching loop's thread:
      # each time the loop asks its scheduler for the next batch, queued prefills run first, with the loop's lock released
      # so that this node's own control requests go on meanwhile.
      self.prefill = PrefillNode(decode.model, decode.node, decode.model_id, on_job=lambda: self._wake(decode))
      schedule = decode.scheduler.schedule
      def prefill_then_schedule():
        if self.prefill.jobs.qsize():
          decode.cond.release()               # held once by the loop around this call
          try:
            self.prefill.run_one()
            while self.prefill.jobs.qsize() and not (decode.scheduler.running or decode.scheduler.waiting): self.prefill.run_one()
          finally: decode.cond.acquire()
        return schedule()
      decode.scheduler.schedule = prefill_then_schedule
    heartbeat.install(decode.node.endpoint, role, lambda: {**decode_status(decode), **(self.prefill.status() if self.prefill else {})})

  @staticmethod
  def _wake(decode):
    with decode.cond: decode.cond.notify_all()

  def close(self):
    if self.prefill is not None: self.prefill.close()

def main_prefill(args) -> int:
  """`tinyhet node --role prefill`: the model on HET, prefill.run, heartbeats; prints {"address", ...} once ready."""
  host, _, port = args.listen.rpartition(":")
  if not host or not port.isdigit():
    print(f"tinyhet node: --listen {args.listen!r} is not host:port (e.g. 0.0.0.0:7471)", file=sys.stderr)
    return 2
  import tinyhet  # noqa: F401  (HET and MESH)
  from tinyhet import service_model
  from tinyhet.memory import local_node
  from tinyhet.prefill_node import PrefillNode
  node = local_node()
  model, _, model_id = service_model.load(args.model, "HET", args.max_context, args.quiet, packed=not args.float_weights)
  prefill = PrefillNode(model, node, model_id)
  heartbeat.install(node.endpoint, "prefill", lambda: {**prefill.status(), "max_context": model.cfg.max_context})
  try: address = node.serve(host, int(port))
  except OSError as e:
    print(f"tinyhet node: cannot listen on {args.listen}: {e.strerror or e}: choose another --listen address or port", file=sys.stderr)
    return 2
  print(json.dumps({"address": address, "node": node.name, "model": model_id, "role": "prefill", "transports": node.endpoint.transports}), flush=True)
  stop = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stop.set())
  if args.stdin_stop: threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
  try: prefill.run(stop)
  except KeyboardInterrupt: pass
  prefill.close()
  node.endpoint.close()
  return 0
