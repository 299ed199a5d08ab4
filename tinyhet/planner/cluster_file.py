"""The cluster file (TOML) the planner reads: the nodes, the links between them, and what was measured on them.

  description = "DGX Spark + Mac Studio over 10 GbE"
  [nodes.spark]                      # a server of `count` identical accelerators (tensor-parallel), `replicas` such servers
  device = "dgx-spark"               # a catalog device, or one defined below under [devices.NAME]
  [nodes.mac]
  device = "m3-ultra-256"
  [devices.m3-ultra-256]             # optional: a device of your own; `like` copies a catalog entry, keys override it
  like = "m3-ultra"
  memory_gb = 256
  [[links]]                          # one per pair of nodes (and per node with replicas > 1, nodes = [name, name])
  nodes = ["spark", "mac"]
  bandwidth_gbit_s = 10              # or bandwidth_gb_s (bytes); per direction
  latency_us = 50
  [[calibration]]                    # measured figures override spec sheets
  node = "spark"
  model = "llama-3-8b"
  prompt_len = 8192
  output_len = 32
  prefill_s = 1.47                   # and/or decode_s; or prefill_tok_s / decode_tok_s; or e2e_tok_s; or prefill_tflops / decode_gb_s;
                                     # or throughput_tok_s with concurrency (or rate): a serving measurement

Every problem raises ClusterFileError naming the file, the key and the fix.
"""
from __future__ import annotations
import dataclasses, difflib, pathlib, re, tomllib
from dataclasses import dataclass, field
from tinyhet.planner.catalog import DTYPE_BYTES, WIDER, ClusterFileError, Device, Link, Model, PlanError, find_device, find_model
from tinyhet.planner.cluster_nodes import serving_nodes
from tinyhet.planner.calibration import Fit, Row, fit
from tinyhet.planner.roofline import Node, cannot_hold

@dataclass(frozen=True)
class Cluster:
  """Nodes, the links between them (keyed by the sorted pair of node names) and the file's own devices and models."""
  nodes: tuple[Node, ...]
  links: dict[tuple[str, str], Link]
  devices: dict[str, Device] = field(default_factory=dict)
  models: dict[str, Model] = field(default_factory=dict)
  source: str = "<cluster>"
  description: str = ""
  calibration: str = ""                 # the joint fit in one line: rows, bounds, residual (tinyhet.calibration.Fit.summary)
  warnings: tuple[str, ...] = ()        # one line per calibration row the fit cannot explain within the bounds
  calibration_errors: dict[str, float] = field(default_factory=dict)  # row key -> predicted / measured - 1 after the fit

  def node(self, name: str) -> Node: return next(n for n in self.nodes if n.name == name)
  def link(self, a: str, b: str) -> Link: return self.links[pair(a, b)]
  def model(self, name: str, dtype: str | None = None) -> Model:
    """A model by name (the file's, then the catalog's), in `dtype` when given."""
    model = find_model(name, self.models)
    if dtype is not None and dtype not in DTYPE_BYTES: raise PlanError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    return model.with_dtype(dtype) if dtype else model

def pair(a: str, b: str) -> tuple[str, str]: return (a, b) if a <= b else (b, a)

TOP = {"description": "a line about the cluster", "devices": "[devices.NAME] tables", "models": "[models.NAME] tables",
       "nodes": "[nodes.NAME] tables", "links": "[[links]] entries", "calibration": "[[calibration]] entries"}
LINK = {"bandwidth_gbit_s": "bandwidth per direction in Gbit/s, e.g. 400", "bandwidth_gb_s": "bandwidth per direction in GB/s, e.g. 900",
        "latency_us": "one-way latency in microseconds, e.g. 5"}
DEVICE = {"like": "a catalog device to start from", "tflops": "dense TFLOP/s per dtype, e.g. { fp16 = 989, fp8 = 1979 }",
          "bandwidth_gb_s": "memory bandwidth in GB/s", "memory_gb": "memory in GB", "intra_link": "link between accelerators of a server",
          "source": "where the figures come from"}
MODEL = {"like": "a catalog model to start from", "params_b": "parameters in billions", "active_params_b": "MoE: active parameters in billions",
         "layers": "transformer layers", "hidden": "hidden size", "heads": "attention heads", "kv_heads": "KV heads", "head_dim": "head dimension",
         "dtype": f"weight dtype ({', '.join(DTYPE_BYTES)})", "kv_dtype": "KV cache dtype", "experts": "MoE: routed experts per layer",
         "experts_active": "MoE: routed experts per token", "kv_dim": "KV elements per token per layer", "attn_dim": "heads x (qk + v head dim)",
         "dense_layers": "MoE: leading layers with a dense MLP", "source": "where the shape comes from"}
NODE = {"device": "a catalog device or one under [devices]", "count": "identical accelerators in the server (tensor-parallel)",
        "replicas": "identical servers", "intra_link": "link between its accelerators, e.g. { bandwidth_gb_s = 900, latency_us = 2 }",
        "memory_usable": "share of memory for weights + KV, 0..1 (default 0.9)",
        "parallel": 'how its accelerators share the model: "tensor" (default) or "pipeline"',
        # for `tinyhet serve --cluster` (tinyhet.planner.cluster_nodes checks them; the planner does not use them)
        "role": "the node's `tinyhet node --role`: prefill, decode or both", "address": "its --listen HOST:PORT (a list with replicas)",
        # for the nodes themselves (TINYHET_CLUSTER, tinyhet.config.cluster_identity): the only key that may use this node's name
        "public_key": "its public key (`tinyhet keygen`): peers that read this file refuse the name to any other key"}
LINKS = {"nodes": 'the two nodes it joins, e.g. ["a", "b"]', **LINK}
CALIBRATION = {"node": "the node measured", "model": "the model it served alone", "dtype": "dtype it ran in (default: the model's)",
               "prompt_len": "prompt tokens", "output_len": "generated tokens", "prefill_s": "measured prefill seconds",
               "decode_s": "measured decode seconds for output_len tokens", "prefill_tok_s": "measured prompt tokens/s",
               "decode_tok_s": "measured generated tokens/s of one sequence", "e2e_tok_s": "output_len / (prefill + decode seconds)",
               "prefill_tflops": "measured prefill TFLOP/s (tinyhet bench)", "decode_gb_s": "measured decode GB/s (tinyhet bench)",
               "throughput_tok_s": "measured serving throughput, output tokens/s, at concurrency or rate",
               "concurrency": "clients of the throughput measurement (closed loop)", "rate": "requests/s of the throughput measurement",
               "source": "where the measurement comes from"}
# what each measured figure calibrates: a phase ("both": one figure for the whole request, split between phases by the model)
PHASES = {"prefill_s": "prefill", "prefill_tok_s": "prefill", "prefill_tflops": "prefill", "decode_s": "decode", "decode_tok_s": "decode",
          "decode_gb_s": "decode", "e2e_tok_s": "both", "throughput_tok_s": "both"}
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

def _at(key: str, name: str) -> str: return f"{key}.{name}" if key else name

KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array", dict: "a table"}
def _kind(v) -> str: return KINDS.get(type(v), type(v).__name__)

class _Reader:
  """Type- and range-checked reads out of the parsed TOML; the first problem raises ClusterFileError."""
  def __init__(self, source: str): self.source = source

  def fail(self, key: str, problem: str, fix: str): raise ClusterFileError(self.source, key, problem, fix)

  def table(self, value, key: str, fields: dict[str, str], required: tuple[str, ...] = ()) -> dict:
    if not isinstance(value, dict): self.fail(key, f"is {_kind(value)}, not a table", f"write it as a table with keys {', '.join(fields)}")
    for k in value:
      if k not in fields:
        close = difflib.get_close_matches(str(k), fields, 1)
        self.fail(_at(key, str(k)), "unknown key", (f"did you mean {close[0]!r}? " if close else "") + f"known keys: {', '.join(fields)}")
    for k in required:
      if k not in value: self.fail(_at(key, k), "missing", f"add {k} = ... ({fields[k]})")
    return value

  def named(self, value, key: str) -> dict[str, dict]:
    """[key.NAME] tables."""
    if not isinstance(value, dict): self.fail(key, f"is {_kind(value)}, not a table", f"write entries as [{key}.NAME]")
    for name, entry in value.items():
      if not NAME.fullmatch(name): self.fail(f"{key}.{name}", "bad name", "use letters, digits, '-' and '_' (no dots), up to 64 characters")
      if not isinstance(entry, dict): self.fail(f"{key}.{name}", f"is {_kind(entry)}, not a table", f"write it as [{key}.{name}] with its keys")
    return value

  def entries(self, value, key: str) -> list[dict]:
    """[[key]] entries."""
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
      self.fail(key, f"is {_kind(value)}, not a list of tables", f"write each entry as [[{key}]]")
    return value

  def number(self, t: dict, name: str, key: str, hi: float = 1e9, lo_ok: bool = False, default=None) -> float:
    """A positive number (zero too with lo_ok) from 1e-6 to `hi`: every unit here (GB, GB/s, TFLOP/s, us, s) keeps real
    figures inside that, and the arithmetic stays finite."""
    if name not in t: return default
    v, where = t[name], _at(key, name)
    if isinstance(v, bool) or not isinstance(v, int | float):
      self.fail(where, f"is {_kind(v)} ({v!r}), not a number", f"write a number, e.g. {name} = 1")
    if not (v == 0 and lo_ok) and not 1e-6 <= v <= hi:  # NaN fails this too
      self.fail(where, f"is {v!r}", f"write a number from {'0' if lo_ok else '1e-6'} to {hi:g}")
    return float(v)

  def integer(self, t: dict, name: str, key: str, lo: int, hi: int, default=None) -> int:
    if name not in t: return default
    v, where = t[name], _at(key, name)
    if isinstance(v, bool) or not isinstance(v, int):
      self.fail(where, f"is {_kind(v)} ({v!r}), not an integer", f"write a whole number, e.g. {name} = {lo}")
    if not lo <= v <= hi: self.fail(where, f"is {v}", f"write a whole number from {lo} to {hi}")
    return v

  def string(self, t: dict, name: str, key: str, choices=None, default=None) -> str:
    if name not in t: return default
    v, where = t[name], _at(key, name)
    if not isinstance(v, str): self.fail(where, f"is {_kind(v)} ({v!r}), not a string", f'write it in quotes, e.g. {name} = "..."')
    if choices is not None and v not in choices: self.fail(where, f"is {v!r}", f"use one of {', '.join(choices)}")
    return v

  def lookup(self, find, name: str, extra: dict, where: str):
    try: return find(name, extra)
    except PlanError as e: self.fail(where, str(e).split(":", 1)[0], str(e).split(": ", 1)[1])

def _link(r: _Reader, spec, key: str, fields: dict[str, str] = LINK) -> Link:
  r.table(spec, key, fields)
  if ("bandwidth_gbit_s" in spec) == ("bandwidth_gb_s" in spec):
    r.fail(key, "needs exactly one of bandwidth_gbit_s and bandwidth_gb_s", "write e.g. bandwidth_gbit_s = 400 (a NIC) or bandwidth_gb_s = 900")
  bandwidth = r.number(spec, "bandwidth_gbit_s", key, default=0) * 1e9 / 8 or r.number(spec, "bandwidth_gb_s", key) * 1e9
  return Link(bandwidth, r.number(spec, "latency_us", key, lo_ok=True, default=0.0) * 1e-6)

def _device(r: _Reader, name: str, spec: dict) -> Device:
  key = f"devices.{name}"
  r.table(spec, key, DEVICE, () if "like" in spec else ("tflops", "bandwidth_gb_s", "memory_gb"))
  base = r.lookup(find_device, r.string(spec, "like", key), {}, f"{key}.like") if "like" in spec else None
  flops = base.flops if base else {}
  if "tflops" in spec:
    rates = r.table(spec["tflops"], f"{key}.tflops", {d: "dense TFLOP/s" for d in WIDER})
    if not rates: r.fail(f"{key}.tflops", "is empty", "give at least one rate, e.g. tflops = { fp16 = 100 }")
    flops = {d: r.number(rates, d, f"{key}.tflops") * 1e12 for d in rates}
  bandwidth = r.number(spec, "bandwidth_gb_s", key, default=None)
  memory = r.number(spec, "memory_gb", key, default=None)
  intra = _link(r, spec["intra_link"], f"{key}.intra_link") if "intra_link" in spec else (base.intra_link if base else None)
  return Device(name, flops, bandwidth * 1e9 if bandwidth else base.bandwidth, memory * 1e9 if memory else base.memory, intra,
                r.string(spec, "source", key, default=f"defined in {r.source}" + (f" (like {base.name})" if base else "")))

def _model(r: _Reader, name: str, spec: dict) -> Model:
  key = f"models.{name}"
  r.table(spec, key, MODEL, () if "like" in spec else ("params_b", "layers", "hidden", "heads", "kv_heads", "head_dim"))
  base = r.lookup(find_model, r.string(spec, "like", key), {}, f"{key}.like") if "like" in spec else None
  values = dataclasses.asdict(base) if base else {}
  if base and base.active_params == base.params: values["active_params"] = 0.0      # dense stays dense when params change
  if base and {"heads", "kv_heads", "head_dim"} & set(spec): values |= {"kv_dim": 0, "attn_dim": 0}  # derive them again
  values |= {"name": name, "source": r.string(spec, "source", key, default=f"defined in {r.source}")}
  for k in ("params", "active_params"):
    if f"{k}_b" in spec: values[k] = r.number(spec, f"{k}_b", key) * 1e9
  for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "kv_dim", "attn_dim"):
    if k in spec: values[k] = r.integer(spec, k, key, 1, 1 << 24)
  for k in ("experts", "experts_active", "dense_layers"):
    if k in spec: values[k] = r.integer(spec, k, key, 0, 1 << 16)
  for k in ("dtype", "kv_dtype"):
    if k in spec: values[k] = r.string(spec, k, key, choices=DTYPE_BYTES)
  model = Model(**values)
  if model.active_params > model.params: r.fail(f"{key}.active_params_b", "is larger than params_b", "active parameters are a part of all parameters")
  if (model.experts or model.experts_active) and not 0 < model.experts_active < model.experts:
    r.fail(f"{key}.experts_active", f"is {model.experts_active} with experts = {model.experts}", "give both, with experts_active < experts")
  if model.dense_layers >= model.layers:
    r.fail(f"{key}.dense_layers", f"is {model.dense_layers} of {model.layers} layers", "count only the dense ones")
  return model

def _node(r: _Reader, name: str, spec: dict, devices: dict[str, Device]) -> Node:
  key = f"nodes.{name}"
  r.table(spec, key, NODE, ("device",))
  device = r.lookup(find_device, r.string(spec, "device", key), devices, f"{key}.device")
  count = r.integer(spec, "count", key, 1, 4096, default=1)
  intra = _link(r, spec["intra_link"], f"{key}.intra_link") if "intra_link" in spec else device.intra_link
  if count > 1 and intra is None:
    r.fail(f"{key}.intra_link", f"missing: {count} {device.name} accelerators need the link between them",
           "add intra_link = { bandwidth_gb_s = ..., latency_us = ... } to the node (or to its device)")
  parallel = r.string(spec, "parallel", key, choices=("tensor", "pipeline"), default="tensor")
  return Node(name, device, count, r.integer(spec, "replicas", key, 1, 1024, default=1), intra, parallel,
              r.number(spec, "memory_usable", key, hi=1.0, default=0.9))

def _links(r: _Reader, entries: list[dict], nodes: dict[str, Node]) -> dict[tuple[str, str], Link]:
  links = {}
  for i, spec in enumerate(entries):
    key = f"links[{i}]"
    r.table(spec, key, LINKS, ("nodes",))
    ends = spec["nodes"]
    if not isinstance(ends, list) or len(ends) != 2 or not all(isinstance(e, str) for e in ends):
      r.fail(f"{key}.nodes", f"is {ends!r}", 'name the two nodes it joins, e.g. nodes = ["a", "b"]')
    for end in ends:
      if end not in nodes: r.fail(f"{key}.nodes", f"names {end!r}, which is not a node", f"use one of {', '.join(nodes)} or add [nodes.{end}]")
    if ends[0] == ends[1] and nodes[ends[0]].replicas == 1:
      r.fail(f"{key}.nodes", f"joins {ends[0]!r} to itself but it has one replica", "link two different nodes (a self link is for replicas > 1)")
    if pair(*ends) in links: r.fail(f"{key}.nodes", f"{ends[0]!r} and {ends[1]!r} are linked twice", "keep one [[links]] entry per pair")
    links[pair(*ends)] = _link(r, {k: v for k, v in spec.items() if k != "nodes"}, key)
  names = list(nodes)
  for i, a in enumerate(names):
    for b in names[i:] if nodes[a].replicas > 1 else names[i + 1:]:
      if pair(a, b) not in links:
        what = f"between the {nodes[a].replicas} replicas of {a!r}" if a == b else f"between {a!r} and {b!r}"
        r.fail("links", f"no link {what}", f'add [[links]] with nodes = ["{a}", "{b}"], bandwidth_gbit_s = ... and latency_us = ...')
  return links

def _calibrate(r: _Reader, entries: list[dict], nodes: dict[str, Node], models: dict[str, Model]) -> Fit:
  """Measured figures -> rows (tinyhet.calibration.Row), fitted together to every measured node's efficiencies."""
  done: dict[tuple[str, str], str] = {}
  rows, notes = [], {}
  for i, spec in enumerate(entries):
    key = f"calibration[{i}]"
    r.table(spec, key, CALIBRATION, ("node",))
    name = r.string(spec, "node", key)
    if name not in nodes: r.fail(f"{key}.node", f"{name!r} is not a node", f"use one of {', '.join(nodes)}")
    node, num = nodes[name], lambda k: r.number(spec, k, key)
    measured = [k for k in PHASES if k in spec]
    if not measured:
      r.fail(key, "measures nothing",
             "add prefill_s/decode_s, prefill_tok_s/decode_tok_s, e2e_tok_s, throughput_tok_s or prefill_tflops/decode_gb_s")
    for k in measured:
      for phase in (["prefill", "decode"] if PHASES[k] == "both" else [PHASES[k]]):
        if (name, phase) in done:
          r.fail(f"{key}.{k}", f"calibrates {name}'s {phase} again ({done[name, phase]} did already)", "keep one measurement per phase")
        done[name, phase] = f"{key}.{k}"
    for k in ("concurrency", "rate"):
      if k in spec and "throughput_tok_s" not in spec:
        r.fail(f"{key}.{k}", "is given without throughput_tok_s", "add throughput_tok_s = ... or drop it")
    dtype = r.string(spec, "dtype", key, choices=DTYPE_BYTES)
    note = r.string(spec, "source", key, default="")
    for k in ("prefill_tflops", "decode_gb_s"):
      if k in spec: rows.append(Row(f"{key}.{k}", name, k, num(k), dtype=dtype or "fp16", what=f"{k} = {spec[k]:g}"))
    timed = [k for k in measured if k not in ("prefill_tflops", "decode_gb_s")]
    if timed:
      for k in ("model", "prompt_len") + (("output_len",) if any(k.startswith(("decode", "e2e", "throughput")) for k in timed) else ()):
        if k not in spec: r.fail(f"{key}.{k}", f"missing (needed with {timed[0]})", f"add {k} = ... ({CALIBRATION[k]})")
      model = r.lookup(find_model, r.string(spec, "model", key), models, f"{key}.model")
      model = model.with_dtype(dtype) if dtype else model
      prompt_len, output_len = r.integer(spec, "prompt_len", key, 1, 1 << 24), r.integer(spec, "output_len", key, 1, 1 << 24, default=1)
      if (why := cannot_hold(node, model, prompt_len + output_len)):
        r.fail(key, f"measures something the node cannot run ({why})", "check the node's device, count and memory_usable")
      for whole in ("e2e_tok_s", "throughput_tok_s"):
        if whole in spec and len(timed) > 1: r.fail(f"{key}.{whole}", "is given with other figures", f"give {whole} alone in its entry")
      shape = dict(model=model, prompt_len=prompt_len, output_len=output_len)
      how = ""
      if "throughput_tok_s" in spec:
        if ("concurrency" in spec) == ("rate" in spec):
          r.fail(f"{key}.throughput_tok_s", "needs exactly one of concurrency and rate",
                 "add concurrency = N (clients) or rate = R (requests/s) of the measurement")
        conc, rate = r.integer(spec, "concurrency", key, 1, 100_000), r.number(spec, "rate", key, hi=1e6)
        how = f" at {f'concurrency {conc}' if conc else f'{rate:g} requests/s'}"
        rows.append(Row(f"{key}.throughput_tok_s", name, "throughput_tok_s", num("throughput_tok_s"), concurrency=conc, rate=rate,
                        what=f"{name}, throughput_tok_s = {spec['throughput_tok_s']:g}{how}", **shape))
      for k, kind, value in (("prefill_s", "prefill_s", lambda: num("prefill_s")),
                             ("prefill_tok_s", "prefill_s", lambda: prompt_len / num("prefill_tok_s")),
                             ("decode_s", "decode_s", lambda: num("decode_s")),
                             ("decode_tok_s", "decode_s", lambda: output_len / num("decode_tok_s")),
                             ("e2e_tok_s", "total_s", lambda: output_len / num("e2e_tok_s"))):
        if k in spec: rows.append(Row(f"{key}.{k}", name, kind, value(), what=f"{name}, {k} = {spec[k]:g}", **shape))
      figures = f"{', '.join(f'{k} = {spec[k]:g}' for k in timed)} for {model.name}, {prompt_len}-token prompt" + \
                (f", {output_len} tokens" if "output_len" in spec else "") + how
      note = f"{note}: {figures}" if note else figures
    notes[name] = "; ".join(filter(None, [notes.get(name, ""), note or "measured"]))
  result = fit(nodes, rows)
  nodes |= {n: dataclasses.replace(result.nodes[n], calibration=notes[n]) for n in notes}
  return result

def parse_cluster(data: dict, source: str = "<cluster>") -> Cluster:
  """A Cluster from parsed TOML (a dict); raises ClusterFileError on the first problem."""
  r = _Reader(source)
  r.table(data, "", TOP, ("nodes",))
  devices = {name: _device(r, name, spec) for name, spec in r.named(data.get("devices", {}), "devices").items()}
  models = {name: _model(r, name, spec) for name, spec in r.named(data.get("models", {}), "models").items()}
  nodes = {name: _node(r, name, spec, devices) for name, spec in r.named(data["nodes"], "nodes").items()}
  if not nodes: r.fail("nodes", "is empty", "add at least one [nodes.NAME] with device = ...")
  links = _links(r, r.entries(data.get("links", []), "links"), nodes)
  calibration = _calibrate(r, r.entries(data.get("calibration", []), "calibration"), nodes, models)
  serving_nodes(data, source)     # the nodes' role and address keys: checked here too, so `tinyhet plan` says what `tinyhet serve` would
  return Cluster(tuple(nodes.values()), links, devices, models, source, r.string(data, "description", "", default=""),
                 calibration.summary(), calibration.warnings, calibration.errors)

def load_cluster(path: str | pathlib.Path) -> Cluster:
  """Read and check a cluster file (TOML). Raises ClusterFileError naming the file, the key and the fix."""
  return parse_cluster(read_toml(path), str(path))

def read_toml(path: str | pathlib.Path) -> dict:
  """A cluster file's TOML, parsed but not checked. Raises ClusterFileError when it cannot be read or is not TOML."""
  path, where = pathlib.Path(path), str(path)
  try: text = path.read_bytes().decode("utf-8")
  except FileNotFoundError: raise ClusterFileError(where, "(file)", "no such file", "check the path; examples are in examples/clusters/") from None
  except UnicodeDecodeError as e: raise ClusterFileError(where, "(file)", f"is not UTF-8 ({e.reason} at byte {e.start})", "save as UTF-8") from None
  except OSError as e: raise ClusterFileError(where, "(file)", f"cannot be read ({e.strerror})", "check the path and its permissions") from None
  try: data = tomllib.loads(text)
  except (tomllib.TOMLDecodeError, RecursionError) as e:
    raise ClusterFileError(where, "(syntax)", f"is not valid TOML: {e}", "fix the TOML syntax there (README: the cluster file)") from None
  return data
