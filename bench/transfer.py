"""`tinyhet bench transfer`: each transport between two processes against the baselines of the same run.

Baselines: numpy memcpy of the same bytes in the same block size (for shm), plain Python socket streams over loopback
into preallocated buffers, as many as tinyhet's tcp transport opens per peer (tcp_streams, default 4; for tcp), and a
plain socket send of 4 KiB (for the write-with-notification latency).
Latency is one way, to the receiver's notice, for the baseline and the transports alike: from the writer starting a send
(or posting a write) to the receiving process holding all 4 KiB (the socket's last recv_into returned; the transport's
notice delivered), both read from the host's one monotonic clock (perf_counter is CLOCK_MONOTONIC on Linux). Rounds are
paced (the writer waits for the reply or the completion, then ROUND_GAP) so that each starts with an idle receiver.
Every transport run writes `total` bytes in blocks scattered over a remote region in another process, then checks the
remote bytes by checksum.
"""
from __future__ import annotations
import argparse, hashlib, json, multiprocessing, os, socket, statistics, sys, time
import numpy as np

BLOCKS = (64 << 10, 1 << 20, 16 << 20)
LATENCY_ROUNDS = 300
ROUND_GAP = 1e-3          # seconds between latency rounds: the receiver has gone back to waiting before the next one

def progress(msg: str, quiet: bool):
  if not quiet: print(msg, file=sys.stderr, flush=True)

def memcpy_gbps(block: int, total: int, src: np.ndarray, dst: np.ndarray) -> float:
  n, st = len(src) // block, time.perf_counter()
  for i in range(total // block):
    j = (i * 7919) % n      # the same scattered order the transports use
    dst[j * block:(j + 1) * block] = src[j * block:(j + 1) * block]
  return total / (time.perf_counter() - st) / 1e9

ALL_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

def pin(cpu: int | None):
  """Pin the calling thread (and the threads it starts later) to one CPU, or back to all with None. Latency is measured
  with the writer on one CPU and the receiver on another, for the baseline and the transports alike: left to the
  scheduler, two processes on 2 cores sometimes share one (a 4 KiB round trip ~13 µs here) and sometimes not (~50 µs),
  which would make one run's figures incomparable. Throughput runs unpinned, using the cores as a real node would."""
  if len(ALL_CPUS) >= 2: os.sched_setaffinity(0, set(ALL_CPUS) if cpu is None else {ALL_CPUS[cpu]})

def _receive(conn, block: int, total: int):
  buf, got = memoryview(bytearray(block)), 0
  while got < total:
    k = conn.recv_into(buf[got % block:], block - got % block)
    if k == 0: return
    got += k

def _raw_socket_server(port_queue, block: int, total: int, rounds: int, times_queue, streams: int = 1):
  import threading
  srv = socket.create_server(("127.0.0.1", 0), backlog=streams)
  port_queue.put(srv.getsockname()[1])
  conns = [srv.accept()[0] for _ in range(streams)]
  for c in conns: c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  share = total // streams
  readers = [threading.Thread(target=_receive, args=(c, block, share)) for c in conns]
  for t in readers: t.start()
  for t in readers: t.join()
  conns[0].sendall(b"k")
  pin(1)
  conn, _ = srv.accept()      # the round trips on a fresh connection: a connection that just streamed a GiB answers slower
  conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  small, arrived = memoryview(bytearray(4096)), []
  for _ in range(rounds):
    got = 0
    while got < 4096: got += conn.recv_into(small[got:], 4096 - got)
    arrived.append(time.perf_counter())       # the receiver holds all 4 KiB: its notice
    conn.sendall(b"k")
  times_queue.put(arrived)

def raw_socket(block: int, total: int, streams: int = 1) -> tuple[float, float]:
  """(GB/s of `streams` plain socket streams together, each sending its share in its own thread, median µs from starting
  a 4 KiB send to the receiver holding it), peer in another process."""
  import threading
  ctx = multiprocessing.get_context("spawn")
  q, times = ctx.Queue(), ctx.Queue()
  p = ctx.Process(target=_raw_socket_server, args=(q, block, total, LATENCY_ROUNDS, times, streams), daemon=True)
  p.start()
  port = q.get(timeout=30)
  socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
  for sock in socks: sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  data = memoryview(bytearray(np.random.default_rng(0).integers(0, 256, block, dtype=np.uint8).tobytes()))
  share = total // streams
  def send(sock):
    left = share
    while left > 0:
      sock.sendall(data[:min(block, left)])
      left -= min(block, left)
  st = time.perf_counter()
  writers = [threading.Thread(target=send, args=(sock,)) for sock in socks]
  for t in writers: t.start()
  for t in writers: t.join()
  socks[0].recv(1)
  gbps = streams * share / (time.perf_counter() - st) / 1e9
  for sock in socks: sock.close()
  pin(0)
  sock = socket.create_connection(("127.0.0.1", port))
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  sent, small = [], data[:4096]
  for _ in range(LATENCY_ROUNDS):
    sent.append(time.perf_counter())
    sock.sendall(small)
    sock.recv(1)
    time.sleep(ROUND_GAP)
  arrived = times.get(timeout=30)
  sock.close()
  pin(None)
  p.join(10)
  return gbps, statistics.median(b - a for a, b in zip(sent, arrived)) * 1e6

def run_transport(transport: str, block: int, total: int, region_bytes: int, node, lat_node, ep, src) -> dict:
  from tinyhet.runtime.transport import Span
  from tinyhet.runtime.descriptor import RegionDescriptor
  exposed = node.ask(cmd="expose", nbytes=region_bytes)
  node.ask(cmd="fill", region=exposed["region"], seed=0)      # fault the pages in first, as a decode node's KV pool is
  desc = RegionDescriptor.from_hex(exposed["desc"])
  peer = ep.connect(node.address, transport)
  n = region_bytes // block
  # block i goes to block (i * 7919) % n: an odd stride over a power-of-two count visits every block, and no two neighbours coalesce
  spans = [Span(src, j * block, desc, j * block, block) for j in ((i * 7919) % n for i in range(total // block))]
  per_batch = max(1, (16 << 20) // block)          # 16 MiB of blocks per batch, up to 4 batches in flight
  def write_all(spans) -> float:
    inflight, st = [], time.perf_counter()
    for b in range(0, len(spans), per_batch):
      inflight.append(ep.write(peer, spans[b:b + per_batch], notify=b))
      if len(inflight) >= 4: inflight.pop(0).wait(120)
    for t in inflight: t.wait(120)
    node.ask(cmd="notices", count=len(range(0, len(spans), per_batch)), timeout=30)
    return time.perf_counter() - st
  # warm-up pass over the region, untimed: a KV pool is written over and over, so the steady state is what counts
  # (the first touch of each page costs a page-table fault on both sides, ~1 µs per 4 KiB page here)
  write_all(spans[:n])
  gbps = total / write_all(spans) / 1e9
  if node.ask(cmd="sha", region=exposed["region"])["sha"] != hashlib.sha256(src.view(0, region_bytes)).hexdigest():
    raise RuntimeError(f"{transport}: the remote bytes differ from what was written ({block}-byte blocks)")
  peer.close()
  # latency on a fresh connection to a receiver pinned to the other CPU, this thread (and the link's) pinned to the first
  pin(0)
  peer = ep.connect(lat_node.address, transport)
  small_desc = RegionDescriptor.from_hex(lat_node.ask(cmd="expose", nbytes=4096)["desc"])
  posted = []
  for i in range(LATENCY_ROUNDS):
    posted.append(time.perf_counter())
    ep.write(peer, [Span(src, 0, small_desc, 0, 4096)], notify=i).wait(10)
    time.sleep(ROUND_GAP)
  got = lat_node.ask(cmd="notices", count=LATENCY_ROUNDS, timeout=30, times=True)
  noticed = {n[1]: t for n, t in zip(got["notices"], got["times"])}      # by value: tcp may deliver them out of order
  peer.close()
  pin(None)
  return {"gbps": gbps, "write_latency_us": statistics.median(noticed[i] - posted[i] for i in range(LATENCY_ROUNDS)) * 1e6}

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench transfer", description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
  ap.add_argument("--quick", action="store_true", help="128 MiB per measurement instead of 1 GiB (under a minute)")
  ap.add_argument("--total", type=str, default=None, help="bytes per measurement (default 1G, --quick 128M)")
  ap.add_argument("--transports", default="auto", help="comma list of shm,tcp,verbs (default: every one available here)")
  args = ap.parse_args(argv)
  from tinyhet.config import parse_bytes, load_config
  from tinyhet.runtime.arena import Arena
  from tinyhet.runtime.transport import Endpoint, available_transports
  from tinyhet.runtime.memory_node import fill
  total = parse_bytes(args.total or ("128M" if args.quick else "1G"), "--total")
  avail = available_transports(load_config())
  wanted = args.transports.split(",") if args.transports != "auto" else ["shm", "tcp", "verbs"]
  skipped = {t: avail.get(t, "unknown transport") for t in wanted if avail.get(t, "unknown transport") is not None}
  transports = [t for t in wanted if t not in skipped]
  region_bytes = min(total, 256 << 20)
  quiet = args.json

  progress(f"baselines: memcpy and raw sockets, {total >> 20} MiB per block size", quiet)
  src_np, dst_np = np.random.default_rng(1).integers(0, 256, region_bytes, dtype=np.uint8), np.ones(region_bytes, np.uint8)
  baselines = {b: {"memcpy_gbps": memcpy_gbps(b, total, src_np, dst_np)} for b in BLOCKS}
  streams = load_config().tcp_streams         # the baseline opens as many streams as tinyhet's tcp transport does
  for b in BLOCKS: baselines[b]["socket_gbps"], baselines[b]["send_4k_us"] = raw_socket(b, total, streams)
  del dst_np

  node = memory_node(region_bytes * len(BLOCKS) * len(transports) + (64 << 20))
  lat_node = memory_node(64 << 20, cpu=1, token=node.token)
  ep = Endpoint("bench-writer", token=node.token, config=load_config(env={}))
  arena = Arena(region_bytes, "bench-src", hugepages=True)
  src = arena.alloc(region_bytes)
  fill(src.view(), 1)
  results = []
  try:
    for t in transports:
      for b in BLOCKS:
        progress(f"{t}: {total >> 20} MiB in {b >> 10} KiB blocks", quiet)
        r = run_transport(t, b, total, region_bytes, node, lat_node, ep, src)
        base = baselines[b]["memcpy_gbps"] if t == "shm" else baselines[b]["socket_gbps"]
        results.append({"transport": t, "block_bytes": b, "gbps": round(r["gbps"], 3), "ratio_to_baseline": round(r["gbps"] / base, 3),
                        "write_latency_us": round(r["write_latency_us"], 1), "baseline": "memcpy" if t == "shm" else "socket",
                        "latency_ratio_to_socket": round(r["write_latency_us"] / baselines[b]["send_4k_us"], 2)})
  finally:
    ep.close()
    node.close()
    lat_node.close()
  one_mib = baselines[1 << 20]
  out = {"baselines": {"memcpy_gbps": round(one_mib["memcpy_gbps"], 3), "socket_gbps": round(one_mib["socket_gbps"], 3),
                       "socket_streams": streams, "socket_4k_us": round(statistics.median(b["send_4k_us"] for b in baselines.values()), 1),
                       "per_block": {str(b): {k: round(v, 3) for k, v in d.items()} for b, d in baselines.items()}},
         "results": results, "unavailable": skipped, "total_bytes": total}
  if args.json: print(json.dumps(out))
  else: print(table(out))
  return 0

def table(out: dict) -> str:
  rows = [f"{'transport':<10}{'block':>8}{'GB/s':>9}{'baseline':>10}{'base GB/s':>11}{'ratio':>8}{'4K write µs':>13}{'vs sock':>8}"]
  for r in out["results"]:
    base = out["baselines"]["per_block"][str(r["block_bytes"])]["memcpy_gbps" if r["baseline"] == "memcpy" else "socket_gbps"]
    rows.append(f"{r['transport']:<10}{_size(r['block_bytes']):>8}{r['gbps']:>9.2f}{r['baseline']:>10}{base:>11.2f}{r['ratio_to_baseline']:>8.2f}"
                f"{r['write_latency_us']:>13.1f}{r['latency_ratio_to_socket']:>8.2f}")
  rows.append(f"raw socket 4 KiB send to the receiver's notice: {out['baselines']['socket_4k_us']:.1f} µs (4K write: to the receiver's notice "
              f"too); {out['total_bytes'] >> 20} MiB per row; the tcp baseline: {out['baselines']['socket_streams']} socket streams, as tinyhet's")
  rows += [f"{t}: unavailable ({why})" for t, why in out["unavailable"].items()]
  return "\n".join(rows)

def _size(n: int) -> str: return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"

def memory_node(arena_bytes: int, cpu: int | None = None, token: str | None = None):
  """The receiving end: tinyhet.runtime.memory_node in a child process, pinned to cpu if given."""
  import secrets
  from tinyhet.runtime.memory_node import MemoryNodeProcess
  return MemoryNodeProcess(token or secrets.token_hex(16), "bench-receiver", arena_bytes=arena_bytes,
                           preexec_fn=None if cpu is None else (lambda: pin(cpu)), extra=("--transport", "verbs"))   # serves verbs too

if __name__ == "__main__": sys.exit(main())
