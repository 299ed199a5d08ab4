"""The router's Prometheus metrics (prometheus-client), named like vLLM's where vLLM has one, in a registry of their own so
that several routers can live in one process (tests)."""
from __future__ import annotations
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()     # no *_created series: they double the page and no dashboard reads them

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)

class Metrics:
  def __init__(self):
    r = self.registry = CollectorRegistry()
    self.ttft = Histogram("tinyhet:time_to_first_token_seconds", "Request arrival to first token", registry=r, buckets=LATENCY_BUCKETS)
    self.itl = Histogram("tinyhet:inter_token_latency_seconds", "Time between two tokens of a request", registry=r, buckets=LATENCY_BUCKETS)
    self.e2e = Histogram("tinyhet:e2e_request_latency_seconds", "Request arrival to its last token", registry=r, buckets=LATENCY_BUCKETS)
    self.running = Gauge("tinyhet:num_requests_running", "Requests being prefilled or decoded", registry=r)
    self.waiting = Gauge("tinyhet:num_requests_waiting", "Requests queued in the router for KV room", registry=r)
    self.kv_usage = Gauge("tinyhet:kv_cache_usage_perc", "Used share of a decode node's KV blocks (0..1)", ["node"], registry=r)
    self.prompt_tokens = Counter("tinyhet:prompt_tokens", "Prompt tokens of admitted requests", registry=r)
    self.generation_tokens = Counter("tinyhet:generation_tokens", "Tokens sent to clients", registry=r)
    self.kv_bytes = Counter("tinyhet:kv_transfer_bytes", "KV bytes prefill nodes wrote into decode nodes", registry=r)
    self.kv_seconds = Histogram("tinyhet:kv_transfer_seconds", "Time a prefill's KV writes were in flight", registry=r, buckets=LATENCY_BUCKETS)
    self.node_up = Gauge("tinyhet:node_up", "1 while the node's heartbeats arrive", ["node", "role"], registry=r)
    self.node_work = Counter("tinyhet:node_requests", "Work each node served, by the role it served in (prefill, decode, "
                             "prefill+decode)", ["node", "role"], registry=r)
    self.retries = Counter("tinyhet:request_retries", "Requests moved to another node after one was lost", ["reason"], registry=r)
    self.finished = Counter("tinyhet:request_success", "Finished requests by reason", ["finished_reason"], registry=r)
    self.prefix_queries = Counter("tinyhet:prefix_cache_queries", "Prompt tokens looked up in decode nodes' prefix caches", registry=r)
    self.prefix_hits = Counter("tinyhet:prefix_cache_hits", "Prompt tokens found in decode nodes' prefix caches", registry=r)
    self.kv_pulled_bytes = Counter("tinyhet:kv_pulled_bytes", "Cached prefix KV bytes prefill nodes read out of decode nodes' blocks",
                                   registry=r)
    self.kv_pulled_tokens = Counter("tinyhet:kv_pulled_tokens", "Cached prompt tokens whose KV prefill nodes pulled", registry=r)
    self.kv_pull_seconds = Counter("tinyhet:kv_pull_seconds", "Time prefill nodes' pulls were in flight (post to the last layer read)",
                                   registry=r)
    self.kv_pull_wait_seconds = Counter("tinyhet:kv_pull_wait_seconds", "Time prefill nodes' compute waited for a pulled layer "
                                        "(what the pull added: the rest overlapped the layers before it)", registry=r)
    self.cached_recomputed = Counter("tinyhet:prefix_cache_recomputed_tokens", "Cached prompt tokens a prefill node computed again "
                                     "instead of pulling them (its cost model found that cheaper)", registry=r)
    self.preemptions = Counter("tinyhet:num_preemptions", "Times a decode node preempted a request's sequence (recomputed later)", registry=r)
    self.ram_hits = Counter("tinyhet:prefix_cache_ram_hits", "Prompt tokens decode nodes found in their RAM prefix caches", registry=r)
    self.disk_hits = Counter("tinyhet:prefix_cache_disk_hits", "Prompt tokens decode nodes read back from their KV disk tiers "
                             "(counted in prefix_cache_hits too)", registry=r)
    self.disk_written = Counter("tinyhet:kv_disk_written_bytes", "KV bytes decode nodes spilled to their disk tiers", registry=r)
    self.disk_read = Counter("tinyhet:kv_disk_read_bytes", "KV bytes decode nodes read back from their disk tiers", registry=r)
    self.disk_dropped = Counter("tinyhet:kv_disk_dropped_spills", "Evicted blocks decode nodes did not spill: their disk tier's write "
                                "queue was full (the step never waits for a disk)", registry=r)
    self.disk_bad = Counter("tinyhet:kv_disk_bad_blocks", "Blocks decode nodes' disk tiers dropped unread: a torn write, a bad "
                            "checksum or another model's file", registry=r)
    self.spec_drafted = Counter("tinyhet:spec_draft_tokens", "Tokens decode nodes drafted for speculative decoding", registry=r)
    self.spec_accepted = Counter("tinyhet:spec_accepted_tokens", "Drafted tokens decode nodes accepted (speculative decoding)", registry=r)
    self.last: dict[str, dict] = {}          # node -> the figures of its beat before (node_figures counts what grew)
    self.rejected = Counter("tinyhet:request_rejected", "Requests answered with an error, by HTTP status", ["status"], registry=r)

  def node_figures(self, node: str, beat: dict) -> None:
    """Count what grew since the node's beat before in its cumulative figures (a figure that shrank: the node restarted, it
    counts from zero again)."""
    now = {k: beat[k] for k in ("prefix_hit_tokens", "disk_hit_tokens", "disk_written_bytes", "disk_read_bytes", "disk_dropped_spills",
                                "disk_bad_blocks", "spec_drafted_tokens", "spec_accepted_tokens")
           if isinstance(beat.get(k), int) and not isinstance(beat.get(k), bool) and beat[k] >= 0}
    before = self.last.get(node, {})
    grew = {k: v - before.get(k, 0) if v >= before.get(k, 0) else v for k, v in now.items()}
    if "prefix_hit_tokens" in grew: self.ram_hits.inc(max(0, grew["prefix_hit_tokens"] - grew.get("disk_hit_tokens", 0)))
    for key, counter in (("disk_hit_tokens", self.disk_hits), ("disk_written_bytes", self.disk_written), ("disk_read_bytes", self.disk_read),
                         ("disk_dropped_spills", self.disk_dropped), ("disk_bad_blocks", self.disk_bad),
                         ("spec_drafted_tokens", self.spec_drafted), ("spec_accepted_tokens", self.spec_accepted)):
      if key in grew: counter.inc(grew[key])
    self.last[node] = {**before, **now}

  def exposition(self) -> bytes: return generate_latest(self.registry)
