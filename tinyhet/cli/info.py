"""`tinyhet info`: the configuration, the HET backend, the transports this machine can use (and why not), and arenas.
`tinyhet info --model F`: what tinyhet reads from a model file or directory (architecture, config, tensors, tokenizer), no weights
loaded, and how many tokens a GiB of KV pool holds in the configured kv_dtype (float16's beside it)."""
import json, sys

def main(argv=None) -> int:
  from tinyhet.cli.common import ArgumentParser
  ap = ArgumentParser(prog="tinyhet info", description=__doc__)
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--model", help="a GGUF file or Hugging Face directory: show its architecture and what tinyhet reads from it")
  args = ap.parse_args(argv)
  if args.model is not None: return model_info(args.model, args.json)
  from tinyhet.config import describe
  from tinyhet.runtime.transport import available_transports
  from tinyhet.device.memory import local_node
  from tinyhet.device.backend import resolve_backend
  import tinyhet  # noqa: F401
  node = local_node()
  transports = available_transports(node.config)
  backend = resolve_backend(node.config.het_backend)
  info = {"node": node.name, "config": dict(describe(node.config)), "het_backend": backend,
          "transports": {t: ("available" if why is None else f"unavailable: {why}") for t, why in transports.items()},
          "arena_pages": node.arena("MESH").pages}
  if args.json:
    print(json.dumps(info))
    return 0
  print(f"node        {info['node']}")
  print(f"HET         {backend} (HET_BACKEND={node.config.het_backend})")
  print(f"arenas      {node.config.arena_bytes >> 20} MiB each, {info['arena_pages']}")
  for t, state in info["transports"].items(): print(f"{t:<12}{state}")
  print("config      " + ", ".join(f"{k}={v}" for k, v in info["config"].items()))
  return 0

def model_info(path: str, as_json: bool) -> int:
  from tinyhet.model.weights import describe_model
  d = describe_model(path)
  d["kv"] = kv_capacity(d["config"])
  if as_json:
    print(json.dumps(d))
    return 0
  c = d["config"]
  print(f"model       {path}")
  print(f"format      {d['format']}, architecture {d['architecture']} ({c['arch']}{', ' + ', '.join(d['layout']) if d['layout'] else ''})")
  print(f"shape       {c['n_layers']} layers, dim {c['dim']}, {c['n_heads']} heads / {c['n_kv_heads']} KV heads of {c['head_dim']}, "
        f"hidden {c['hidden_dim']}, vocabulary {c['vocab_size']}, context {c['max_context']}")
  print(f"rope        theta {c['rope_theta']}" + (f", llama3 scaling {c['rope_scaling']}" if c["rope_scaling"] else ""))
  if d.get("sliding_window"): print(f"window      sliding window {d['sliding_window']}: the context is capped to it")
  print(f"tensors     {d['tensors']}, {'/'.join(d['tensor_dtypes'])}")
  print(f"tokenizer   {d['tokenizer']}, {d['vocab_size']} tokens, chat template {'yes' if d['chat_template'] else 'no'}, stop ids {d['stop_ids']}")
  print("read        " + ", ".join(f"{k}={json.dumps(v)}" for k, v in d["config_used"].items() if not isinstance(v, list) or len(v) < 8))
  kv = d["kv"]
  if "problem" in kv: print(f"kv          {kv['problem']}")
  else: print(f"kv          {kv['kv_dtype']}: {kv['bytes_per_token']} bytes a token, {kv['tokens_per_gib']} tokens per GiB of pool "
        f"({kv['tokens_per_gib'] / kv['float16_tokens_per_gib']:.2f}x float16's {kv['float16_tokens_per_gib']})")
  if d.get("config_checked"): print("checked     " + ", ".join(f"{k}={json.dumps(v)}" for k, v in d["config_checked"].items()))
  if d.get("config_ignored"): print("ignored     " + ", ".join(d["config_ignored"]))
  return 0

def kv_capacity(c: dict) -> dict:
  """Tokens a GiB of KV pool holds (all layers, K and V, whole blocks) for the configured kv_dtype and block size, and float16's."""
  from tinyhet.config import load_config
  from tinyhet.kernels.kv_quant import kv_format
  from tinyhet.kv.paged_cache import PagedKVCache
  cfg = load_config()
  def per_gib(name: str) -> tuple[float, int]:
    per_block = PagedKVCache.bytes_per_block(c["n_layers"], c["n_kv_heads"], c["head_dim"], cfg.kv_block_size, kv_format(name))
    return per_block / cfg.kv_block_size, (1 << 30) // per_block * cfg.kv_block_size
  try: (bpt, tokens), (_, f16) = per_gib(cfg.kv_dtype), per_gib("float16")
  except ValueError as e: return {"kv_dtype": cfg.kv_dtype, "block_size": cfg.kv_block_size, "problem": str(e)}
  return {"kv_dtype": cfg.kv_dtype, "block_size": cfg.kv_block_size, "bytes_per_token": bpt, "tokens_per_gib": tokens, "float16_tokens_per_gib": f16}

if __name__ == "__main__": sys.exit(main())
