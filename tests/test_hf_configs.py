"""config.json through the one table of fields (tinyhet.model.hf_config.FIELDS): every field transformers 4.57 and 5.24 write
for Llama, Mistral, Qwen2 and Qwen3 (tests/fixtures/hf/config_keys.json, listed by transformers itself) is classified; the
configs of the Hub's Llama 3.x, Mistral/Ministral, Qwen2.5 and Qwen3 checkpoints (their keys, sizes shrunk) load with the
architecture, context and layout they have; metadata is ignored; a field that changes the model in a way tinyhet lacks is
refused in one line naming it; a sliding window caps the context where it would start to matter."""
import json, pathlib
import pytest
from hypothesis import given, settings, strategies as st
from tinyhet.model.hf_config import FIELDS, METADATA, USED, classify, read_hf_config
from tinyhet.model.model_files import WeightsError

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
HUB = json.loads((FIXTURES / "hub_configs.json").read_text())["configs"]

def write(tmp_path, c: dict) -> pathlib.Path:
  d = tmp_path / "m"
  d.mkdir(exist_ok=True)
  (d / "config.json").write_text(json.dumps(c))
  return d

def test_every_field_transformers_writes_is_classified():
  versions = json.loads((FIXTURES / "hf" / "config_keys.json").read_text())
  assert {v.split(".")[0] for v in versions} == {"4", "5"}
  for version, types in versions.items():
    assert set(types) == {"llama", "mistral", "qwen2", "qwen3"}
    for model_type, keys in types.items():
      unclassified = [k for k in keys if classify(k) is None]
      assert not unclassified, f"transformers {version} {model_type}: {unclassified}"

def test_the_table_has_one_kind_per_field():
  for field, kind in FIELDS.items(): assert kind in (USED, METADATA) or isinstance(kind, tuple), field
  assert classify("_model_name_or_path") == classify("unk_token_id") == classify("_attn_implementation_autoset") == METADATA
  assert classify("num_experts") is None

EXPECT = {  # name -> (model_type, context, q/k/v biases, q/k norms, tied, head_dim, Llama 3.1 RoPE factor)
  "meta-llama/Llama-3.1-8B-Instruct": ("llama", 131072, False, False, False, 16, 8.0),
  "meta-llama/Llama-3.2-1B": ("llama", 131072, False, False, True, 16, 32.0),
  "meta-llama/Llama-3.2-3B": ("llama", 131072, False, False, True, 16, 32.0),
  "meta-llama/Llama-3.3-70B-Instruct": ("llama", 131072, False, False, False, 16, 8.0),
  "mistralai/Mistral-7B-v0.3": ("mistral", 32768, False, False, False, 16, None),
  "mistralai/Ministral-8B-Instruct-2410": ("mistral", 32768, False, False, False, 16, None),
  "Qwen/Qwen2.5-0.5B": ("qwen2", 32768, True, False, True, 16, None),
  "Qwen/Qwen2.5-7B-Instruct": ("qwen2", 32768, True, False, False, 16, None),
  "Qwen/Qwen3-0.6B": ("qwen3", 40960, False, True, True, 32, None),
  "Qwen/Qwen3-8B": ("qwen3", 40960, False, True, False, 32, None),
}

@pytest.mark.parametrize("name", sorted(HUB))
def test_hub_configs_load_with_their_layout(name, tmp_path):
  cfg, read = read_hf_config(write(tmp_path, HUB[name]))
  arch, ctx, bias, norm, tied, head_dim, factor = EXPECT[name]
  assert (cfg.arch, cfg.max_context, cfg.qkv_bias, cfg.qk_norm, cfg.tie_embeddings, cfg.head_dim) == (arch, ctx, bias, norm, tied, head_dim)
  assert (cfg.rope_scaling.factor if cfg.rope_scaling else None) == factor and cfg.rope_theta == float(HUB[name]["rope_theta"])
  assert set(read["used"]) | set(read["checked"]) | set(read["ignored"]) == set(HUB[name]) and "torch_dtype" in read["ignored"]

def test_metadata_transformers_5_adds_is_ignored(tmp_path):
  c = HUB["Qwen/Qwen3-0.6B"] | {"_model_name_or_path": "HuggingFaceTB/SmolLM2-135M", "unk_token_id": 0, "_commit_hash": "abc",
                               "dtype": "float32", "transformers_version": "5.24.0", "pad_token_id": None}
  cfg, read = read_hf_config(write(tmp_path, c))
  assert cfg.arch == "qwen3" and {"_model_name_or_path", "unk_token_id", "_commit_hash"} <= set(read["ignored"])

@pytest.mark.parametrize("name,change,says", [
  ("Qwen/Qwen2.5-7B-Instruct", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, 'rope_type = "yarn"'),
  ("meta-llama/Llama-3.1-8B-Instruct", {"attention_bias": True}, "attention_bias = true changes the model"),
  ("meta-llama/Llama-3.1-8B-Instruct", {"mlp_bias": True}, "mlp_bias = true"),
  ("Qwen/Qwen3-8B", {"attention_bias": True}, "attention_bias = true"),
  ("mistralai/Mistral-7B-v0.3", {"hidden_act": "gelu"}, 'hidden_act = "gelu" changes the model'),
  ("Qwen/Qwen2.5-0.5B", {"use_mrope": True}, "use_mrope = true"),
  ("Qwen/Qwen2.5-0.5B", {"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
  ("Qwen/Qwen3-0.6B", {"num_experts": 8}, "num_experts = 8 is not a field tinyhet knows for Qwen3ForCausalLM"),
  ("Qwen/Qwen3-0.6B", {"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
  ("Qwen/Qwen3-0.6B", {"model_type": "qwen3_moe"}, "model_type 'qwen3_moe' is not supported"),
  ("Qwen/Qwen3-0.6B", {"num_hidden_layers": 0}, "num_hidden_layers is missing or not a positive integer"),
  ("Qwen/Qwen3-0.6B", {"rms_norm_eps": "small"}, "wrong type"),
  ("Qwen/Qwen3-0.6B", {"num_key_value_heads": 3}, "not a multiple of n_kv_heads=3"),
])
def test_model_changing_fields_are_refused_in_one_line_naming_them(name, change, says, tmp_path):
  with pytest.raises(WeightsError) as e: read_hf_config(write(tmp_path, HUB[name] | change))
  assert says in str(e.value) and "\n" not in str(e.value)

def test_a_sliding_window_caps_the_context_where_it_would_matter(tmp_path):
  v01 = HUB["mistralai/Mistral-7B-v0.3"] | {"sliding_window": 4096}                 # Mistral-7B-v0.1: every layer slides
  assert read_hf_config(write(tmp_path, v01))[0].max_context == 4096
  q = HUB["Qwen/Qwen2.5-7B-Instruct"] | {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1}   # 4.x: layer 1 slides
  cfg, read = read_hf_config(write(tmp_path, q))
  assert cfg.max_context == 4096 and read["sliding_window"] == 4096
  assert read_hf_config(write(tmp_path, q | {"max_window_layers": 2}))[0].max_context == 32768      # no layer from 2 on: no window
  types = q | {"layer_types": ["full_attention", "sliding_attention"]}                           # 5.x names each layer
  assert read_hf_config(write(tmp_path, types))[0].max_context == 4096
  assert read_hf_config(write(tmp_path, types | {"layer_types": ["full_attention"] * 2}))[0].max_context == 32768
  ministral = HUB["mistralai/Ministral-8B-Instruct-2410"] | {"model_type": "ministral", "architectures": ["MinistralForCausalLM"],
                                                            "sliding_window": 4096, "layer_types": ["sliding_attention", "full_attention"]}
  assert read_hf_config(write(tmp_path, ministral))[0].max_context == 4096    # transformers' Ministral: windows by layer_types

@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text(st.characters(codec="ascii"), min_size=1, max_size=12),
                       st.none() | st.booleans() | st.integers() | st.text(max_size=5), max_size=3))
def test_any_extra_field_is_used_ignored_or_refused_by_name(extra):
  import tempfile
  c = HUB["Qwen/Qwen3-0.6B"] | extra
  with tempfile.TemporaryDirectory() as t:
    d = pathlib.Path(t)
    (d / "config.json").write_text(json.dumps(c))
    try: read_hf_config(d)
    except WeightsError as e:
      assert "\n" not in str(e) and any(k in str(e) or json.dumps(k) in str(e) for k in c)
      return
  assert all(classify(k) is not None for k in c)
