"""The router's HTTP API (`tinyhet serve`, started by tinyhet.cli.serve): OpenAI-compatible, on Starlette and uvicorn, in front of
prefill and decode nodes.

  POST /v1/completions, /v1/chat/completions   streaming (server-sent events, `data: [DONE]`, a usage chunk with
                                               stream_options.include_usage) or not; `return_token_ids` (as in vLLM)
                                               adds the generated token ids; `n` samples of each prompt and a list of
                                               prompts give one choice each (index = prompt * n + sample), the samples
                                               of a prompt from one prefill (tinyhet.service.samples)
  POST /tokenize, /detokenize                  vLLM's (tinyhet.service.tokenize_api)
  GET  /v1/models (with max_model_len), /health (200 while the router runs), /ready (200 once a decode node is up: a path
       from prefill to decode exists, else 503; the node list only with the admin key), /metrics (Prometheus)
With API keys (`tinyhet serve --api-key`, TINYHET_API_KEY) every /v1/* route, /tokenize and /detokenize want `Authorization:
Bearer KEY` (401 in OpenAI's error shape otherwise, keys compared in constant time); /health, /ready and /metrics stay open.
Body size, JSON depth and the admin key: tinyhet.service.http_guard.
Requests are checked here (4xx in OpenAI's error shape, saying what to change), then served by tinyhet.service.router.Cluster on a
thread each; a client that goes away cancels its request and the nodes free what it held.
"""
from __future__ import annotations
import asyncio, json, threading, time, uuid
from tinyhet.service.api_schema import ApiError, parse_chat, parse_completion
from tinyhet.service.http_guard import MAX_BODY_BYTES, BodyLimit, authorization, error_response, is_admin, parse_body
from tinyhet.service.logprobs import LogprobFormatter
from tinyhet.service.tenancy import key_identity, matching_key, tenant_salt
from tinyhet.service.samples import run_samples

class KeyCheck:
  """ASGI middleware: /v1/*, /tokenize and /detokenize need one of the API keys; everything else (/health, /ready, /metrics) is open."""
  def __init__(self, app, keys: list[str]):
    self.app, self.keys = app, [k.encode() for k in keys]
  async def __call__(self, scope, receive, send):
    if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/") or scope["path"] in ("/tokenize", "/detokenize")):
      if (key := matching_key(authorization(scope), self.keys)) is not None: scope["tinyhet.tenant"] = key_identity(key)   # its cache salt
      else:
        reply = error_response(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'", "invalid_request_error",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await reply(scope, receive, send)
    return await self.app(scope, receive, send)

def parse_keys(flags: list[str] | None, env: str | None) -> list[str]:
  """The API keys from --api-key (repeatable) and TINYHET_API_KEY (comma-separated); empty entries are dropped."""
  keys = [k.strip() for k in (flags or [])] + [k.strip() for k in (env or "").split(",")]
  return [k for k in keys if k]

class Service:
  """The HTTP side: one Cluster, the tokenizer, the metrics; api_keys: none (open), or the keys /v1/* accepts."""
  def __init__(self, cluster, tokenizer, model_id: str, metrics, retry_after_s: int = 1, api_keys: list[str] | None = None,
               admin_key: bytes | None = None, max_body: int = MAX_BODY_BYTES, shared_prefix_cache: bool = False):
    """shared_prefix_cache: tenants (API keys) share cached KV (tinyhet.service.tenancy); by default they never do."""
    self.cluster, self.tok, self.model_id, self.metrics, self.retry_after_s = cluster, tokenizer, model_id, metrics, retry_after_s
    self.api_keys, self.admin_key, self.max_body = list(api_keys or []), admin_key, max_body    # http_guard: the admin key, the body limit
    self.shared_prefix_cache = shared_prefix_cache

  def app(self):
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route
    async def http_error(request, exc: HTTPException):
      return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", "invalid_request_error", code=str(exc.status_code))
    routes = [Route("/v1/completions", self.completions, methods=["POST"]), Route("/v1/chat/completions", self.chat, methods=["POST"]),
              Route("/v1/models", self.models), Route("/health", self.health), Route("/ready", self.ready), Route("/metrics", self.metrics_page),
              Route("/tokenize", self.tokenize, methods=["POST"]), Route("/detokenize", self.detokenize, methods=["POST"])]
    from starlette.middleware import Middleware
    # the key first: a client without one is refused before its body is read
    middleware = ([Middleware(KeyCheck, keys=self.api_keys)] if self.api_keys else []) + [Middleware(BodyLimit, max_bytes=self.max_body)]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, middleware=middleware)

  # ---- plain pages
  async def models(self, request):
    from starlette.responses import JSONResponse
    return JSONResponse({"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0, "owned_by": "tinyhet",
                                                      "max_model_len": self.cluster.max_context()}]})

  async def health(self, request):
    from starlette.responses import JSONResponse
    return JSONResponse({"status": "ok"})

  async def ready(self, request):
    from starlette.responses import JSONResponse
    ok = self.cluster.ready()        # the nodes' names and state only for the admin key: a node's name is what its peers trust
    extra = {"nodes": self.cluster.describe()} if is_admin(request.scope, self.admin_key) else {}
    return JSONResponse({"ready": ok, **extra}, status_code=200 if ok else 503)

  async def metrics_page(self, request):
    from prometheus_client import CONTENT_TYPE_LATEST
    from starlette.responses import Response
    return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

  async def tokenize(self, request):
    from starlette.responses import JSONResponse
    from tinyhet.service.tokenize_api import tokenize
    try: return JSONResponse(tokenize(parse_body(await request.body()), self.tok, self.model_id, self.cluster.max_context()))
    except ApiError as e: return error_response(e.status, str(e), param=e.param, code=e.code)

  async def detokenize(self, request):
    from starlette.responses import JSONResponse
    from tinyhet.service.tokenize_api import detokenize
    try: return JSONResponse(detokenize(parse_body(await request.body()), self.tok, self.model_id))
    except ApiError as e: return error_response(e.status, str(e), param=e.param, code=e.code)

  # ---- generation
  async def completions(self, request): return await self._generate(request, chat=False)
  async def chat(self, request): return await self._generate(request, chat=True)

  async def _generate(self, request, chat: bool):
    from starlette.responses import JSONResponse, StreamingResponse
    try:
      body = parse_body(await request.body())
      p = (parse_chat if chat else parse_completion)(body, self.tok, self.model_id, self.cluster.max_context())
      p["cache_salt"] = tenant_salt(request.scope.get("tinyhet.tenant", ""), p.get("cache_salt"), self.shared_prefix_cache)
    except ApiError as e:
      self.metrics.rejected.labels(str(e.status)).inc()
      return error_response(e.status, str(e), param=e.param, code=e.code)
    runs = start(self, p)
    # until the reply starts (and for a non-streaming reply, until it ends) a client that hangs up cancels the request at once;
    # a streaming reply is then watched by Starlette, which stops the generator (choices_sse cancels in its finally)
    watch = asyncio.ensure_future(watch_disconnect(request, [r.req for r in runs]))
    try:
      for run in runs:
        first = await run.next_event()
        if first[0] == "error":
          for r in runs: r.req.cancel()
          return self._failure(first[1])
        run.pending.append(first)
      if p["stream"]:
        watch.cancel()
        return StreamingResponse(choices_sse(runs, chat), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
      results = []
      for run in runs:
        try: results.append(await run.collect())
        except Exception as e:
          for r in runs: r.req.cancel()
          return self._failure(e)
    finally: watch.cancel()
    if any(reason == "cancelled" for _, _, reason in results): return error_response(499, "the client went away", "cancelled")
    choices = []
    for run, (text, ids, reason) in zip(runs, results):
      lps = run.lp.entries(run.prompt_items() + run.items) if p["logprobs"] is not None else None
      if p["echo"]: text = run.prompt_text + text
      message = {"role": "assistant", "content": text}
      if chat and p.get("tools") is not None:            # tool calls parsed out of the reply (tinyhet.service.tools)
        from tinyhet.service.tools import reply_message
        message, reason = reply_message(text, p["tools"], reason)
      choice = ({"index": run.index, "message": message, "logprobs": lps, "finish_reason": reason} if chat else
                {"index": run.index, "text": text, "logprobs": lps, "finish_reason": reason})
      if p["return_token_ids"]: choice["token_ids"] = ids
      choices.append(choice)
    return JSONResponse({"id": runs[0].id, "object": "chat.completion" if chat else "text_completion", "created": runs[0].created,
                         "model": self.model_id, "choices": choices, "usage": usage(runs)})

  def _failure(self, e: Exception):
    """The HTTP answer for a request the cluster could not serve (before any byte of the reply was sent)."""
    from tinyhet.service.router import BadRequest, Overloaded, Unavailable
    retry = {"Retry-After": str(self.retry_after_s)}
    status, kind, headers = {BadRequest: (400, "invalid_request_error", None), Overloaded: (503, "server_overloaded", retry),
                             Unavailable: (503, "service_unavailable", retry)}.get(type(e), (500, "server_error", None))
    self.metrics.rejected.labels(str(status)).inc()
    return error_response(status, str(e), kind, headers=headers)

async def watch_disconnect(request, reqs: list) -> None:
  """Cancel the requests when the client hangs up. The body is read already, so the next ASGI message is the disconnect."""
  while (await request.receive())["type"] != "http.disconnect": pass
  for req in reqs: req.cancel()

def start(svc: Service, p: dict) -> list[Running]:
  """The request's choices, running: for each prompt, n samples (choice index = prompt's index * n + sample), the n samples of
  a prompt as one request to the cluster (tinyhet.service.samples: one prefill, the samples forked from it)."""
  n, runs = p["n"], []
  rid, created = f"{'chatcmpl' if p['chat'] else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
  for k, ids in enumerate(p["prompts"]):
    group = [Running(svc, p, ids, k * n + i, rid, created) for i in range(n)]
    if n == 1: group[0].begin(lambda g=group: svc.cluster.run(g[0].req))
    else: group[0].begin(lambda g=group: run_samples(svc.cluster, [r.req for r in g]), group)
    runs += group
  return runs

def usage(runs: list[Running]) -> dict:
  """OpenAI's usage of a request: each prompt counted once (not once per sample), every choice's tokens."""
  firsts = [r for r in runs if r.index % r.p["n"] == 0]
  prompt, done = sum(len(r.prompt_ids) for r in firsts), sum(r.n_tokens for r in runs)
  return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
          "prompt_tokens_details": {"cached_tokens": sum(r.req.cached_tokens for r in firsts)}}

async def choices_sse(runs: list[Running], chat: bool):
  """The stream of every choice's chunks, as they come, then the usage chunk (stream_options.include_usage) and [DONE]."""
  gens = [r.sse(chat) for r in runs]
  pending = {asyncio.ensure_future(g.__anext__()): g for g in gens}
  try:
    while pending:
      done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
      for task in done:
        g = pending.pop(task)
        try: chunk = task.result()
        except StopAsyncIteration: continue
        yield chunk
        pending[asyncio.ensure_future(g.__anext__())] = g
      if any(r.failed for r in runs): break
    first = runs[0]
    if first.p["include_usage"] and not any(r.failed for r in runs):
      obj = {"id": first.id, "object": "chat.completion.chunk" if chat else "text_completion", "created": first.created,
             "model": first.svc.model_id, "choices": [], "usage": usage(runs)}
      yield f"data: {json.dumps(obj)}\n\n"
    yield "data: [DONE]\n\n"
  finally:
    for task in pending: task.cancel()
    for r in runs: r.req.cancel()          # the client went away mid-stream (or we are done): the nodes free what it held

class Running:
  """One choice of a request in flight: its Request in the Cluster, the events it sends to the event loop, its text and
  metrics. begin() starts the thread that serves it (and, for n samples of a prompt, its group)."""
  def __init__(self, svc: Service, p: dict, prompt_ids: list[int], index: int, rid: str, created: int):
    from tinyhet.service.router import Request
    self.svc, self.p, self.m, self.prompt_ids, self.index = svc, p, svc.metrics, prompt_ids, index
    self.id, self.created = rid, created
    self.loop, self.events = asyncio.get_running_loop(), asyncio.Queue()
    self.pending: list = []
    self.t0, self.t_last, self.n_tokens, self.failed = time.perf_counter(), None, 0, False
    self.decoder, self.text, self.sent, self.stopped = svc.tok.stream_decoder(p["skip_special"], p["spaces_between_special"]), "", 0, False
    self.stop_at = 0 if not p["min_tokens"] else None    # the text's length after min_tokens tokens: no stop string ends before it
    self.req = Request(prompt_ids, p["max_tokens"], self._emit, p["temperature"], p["top_p"], p["seed"], list(p["stop_ids"]),
                       options=p["options"], stop=list(p["stop"]), cache_salt=p["cache_salt"])
    self.items: list = []                   # (token, logprobs) of the tokens counted, for the logprobs of the reply
    self.tool_stream = None                 # a streamed chat reply's tool calls, split from its text (tinyhet.service.tools)
    if p["chat"] and p.get("tools") is not None and p["tools"].parses:
      from tinyhet.service.tools import ToolStream
      self.tool_stream = ToolStream(p["tools"])
    self.prompt_text = svc.tok.decode(prompt_ids) if p["echo"] else ""
    self.lp = LogprobFormatter(svc.tok, p["chat"], 0 if p["echo"] and p["logprobs"] is not None else len(self.prompt_text))
    self.m.prompt_tokens.inc(len(prompt_ids))

  def begin(self, work, group: list | None = None):
    """Serve this choice (or the group of samples it heads) on a thread: work() returns the finish reason (a list of them
    for a group), or raises."""
    group = group or [self]
    for r in group: r.m.running.inc()
    def serve():
      try: reasons, error = work(), None
      except Exception as e: reasons, error = None, e
      finally:
        for r in group: r.m.running.dec()
      for i, r in enumerate(group):
        event = ("error", error) if error is not None else ("done", reasons[i] if isinstance(reasons, list) else reasons)
        r.loop.call_soon_threadsafe(r.events.put_nowait, event)
    threading.Thread(target=serve, name="tinyhet-request", daemon=True).start()

  def prompt_items(self) -> list:
    """With echo and logprobs: the prompt's (token, logprobs), the first token's None, as the node that prefilled computed them."""
    if not (self.p["echo"] and self.p["logprobs"] is not None): return []
    got = self.req.prompt_logprobs or []
    return [(t, got[i] if i < len(got) else None) for i, t in enumerate(self.prompt_ids)]

  def _emit(self, token: int, logprobs: dict | None = None):
    self.loop.call_soon_threadsafe(self.events.put_nowait, ("token", token, time.perf_counter(), logprobs))

  async def next_event(self):
    if self.pending: return self.pending.pop(0)
    return await self.events.get()

  def _token(self, token: int, t: float, logprobs: dict | None = None) -> str:
    """Account for one token; the text it adds that may be sent now (held back while it could begin a stop string)."""
    if self.stopped: return ""              # tokens already on their way when a stop string ended the answer
    self.items.append((token, logprobs))
    self.m.generation_tokens.inc()
    if self.t_last is None: self.m.ttft.observe(t - self.t0)
    else: self.m.itl.observe(t - self.t_last)
    self.t_last, self.n_tokens = t, self.n_tokens + 1
    if token not in self.req.stop_ids or self.p["include_stop"]: self.text += self.decoder.push(token)   # a stop id's text: vLLM's rule
    if self.stop_at is None and self.n_tokens >= self.p["min_tokens"]: self.stop_at = len(self.text)
    return self._release()

  def _release(self, final: bool = False) -> str:
    stops = self.p["stop"]
    if not self.stopped and self.stop_at is not None:
      # the first stop string that ends past the first min_tokens tokens' text
      hits = [(i, s) for s in stops if (i := self.text.find(s, max(0, self.sent - len(s), self.stop_at - len(s) + 1))) >= 0]
    else: hits = []
    if hits:                                # a stop string: the answer ends before the first one (after it: include_stop_str_in_output)
      i, s = min(hits)
      self.text, self.stopped = self.text[:i + (len(s) if self.p["include_stop"] else 0)], True
      self.req.cancel()
    hold = 0 if final or self.stopped else max((len(s) - 1 for s in stops), default=0)
    out = self.text[self.sent:max(self.sent, len(self.text) - hold)]
    self.sent += len(out)
    return out

  def _finish(self, reason: str) -> str:
    if self.stopped: reason = "stop"
    if reason != "cancelled":
      self.m.e2e.observe(time.perf_counter() - self.t0)
      self.m.finished.labels(reason).inc()
    return reason

  async def collect(self) -> tuple[str, list[int], str]:
    while True:
      ev = await self.next_event()
      if ev[0] == "token": self._token(ev[1], ev[2], ev[3])
      elif ev[0] == "error": raise ev[1]
      else:
        if not self.stopped: self.text += self.decoder.flush()
        self._release(final=True)
        return self.text, self.req.generated[:self.n_tokens], self._finish(ev[1])

  def _chunk(self, chat: bool, piece: str | None, reason: str | None, ids: list[int] | None = None, first: bool = False,
             items: list | None = None, calls: list | None = None) -> str:
    lps = self.lp.entries(items) if items and self.p["logprobs"] is not None else None
    delta = ({"role": "assistant", "content": ""} if first else {"tool_calls": calls} if calls else
             {"content": piece} if piece is not None else {})
    if chat: choice = {"index": self.index, "delta": delta, "logprobs": lps, "finish_reason": reason}
    else: choice = {"index": self.index, "text": piece or "", "logprobs": lps, "finish_reason": reason}
    if ids is not None and self.p["return_token_ids"]: choice["token_ids"] = ids
    obj = {"id": self.id, "object": "chat.completion.chunk" if chat else "text_completion", "created": self.created, "model": self.svc.model_id,
           "choices": [choice]}
    if self.p["include_usage"]: obj["usage"] = None
    return f"data: {json.dumps(obj)}\n\n"

  def _tool_chunks(self, piece: str, final: bool = False) -> list[str]:
    """A streamed chat reply's text through its ToolStream: content chunks, and a delta.tool_calls chunk per finished call."""
    from tinyhet.service.tools import delta_calls
    out, ts = [], self.tool_stream
    before = ts.calls
    content, calls = ts.push(piece)
    if final:
      more, late = ts.finish()
      content, calls = content + more, calls + late
    if content: out.append(self._chunk(True, content, None))
    if calls: out.append(self._chunk(True, None, None, calls=delta_calls(calls, before)))
    return out

  async def sse(self, chat: bool):
    """This choice's chunks (choices_sse merges the choices' and ends the stream); an error event sets failed."""
    if chat: yield self._chunk(chat, None, None, first=True)
    elif self.p["echo"] and self.prompt_text: yield self._chunk(chat, self.prompt_text, None, items=self.prompt_items())
    while True:
      ev = await self.next_event()
      if ev[0] == "token":
        counted = len(self.items)
        piece = self._token(ev[1], ev[2], ev[3])
        items = self.items[counted:]
        if self.tool_stream is not None:
          for c in self._tool_chunks(piece): yield c
          piece = ""
        if piece or self.p["return_token_ids"] or (items and self.p["logprobs"] is not None):
          yield self._chunk(chat, piece, None, [ev[1]], items=items)
      elif ev[0] == "error":
        self.failed = True
        err = {"error": {"message": f"the request failed after it started: {ev[1]}", "type": "server_error", "param": None, "code": None}}
        yield f"data: {json.dumps(err)}\n\n"
        return
      else:
        if not self.stopped: self.text += self.decoder.flush()
        rest, reason = self._release(final=True), self._finish(ev[1])
        if self.tool_stream is not None:
          for c in self._tool_chunks(rest, final=True): yield c
          rest, reason = "", "tool_calls" if self.tool_stream.calls else reason
        yield self._chunk(chat, rest if rest else (None if chat else ""), reason, [])
        return
