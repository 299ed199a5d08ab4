"""The planner's catalog: accelerators with their published specs, and model shapes.

Units: FLOP/s, bytes/s and bytes (GB = 10^9 bytes). FLOP/s are dense (no 2:4 sparsity) tensor-core figures per dtype.
Every entry carries `source`: the spec sheet or figure it comes from, and which numbers are derived rather than published.
A cluster file can add devices and models of its own (tinyhet/planner/cluster_file.py); measured figures there override these.
"""
from __future__ import annotations
import dataclasses
from dataclasses import dataclass

# Bytes per element. bf16 moves and multiplies like fp16; a device's "fp16" rate is its fp16/bf16 tensor rate.
DTYPE_BYTES = {"fp4": 0.5, "fp8": 1.0, "fp16": 2.0, "bf16": 2.0, "fp32": 4.0}
WIDER = ["fp4", "fp8", "fp16", "fp32"]  # a device lacking a dtype computes it at the next wider rate it has
ACTIVATION_BYTES = 2                    # activations exchanged between accelerators of a node (bf16)

T, G = 1e12, 1e9

@dataclass(frozen=True)
class Link:
  """A link between two accelerators or two nodes: bandwidth in bytes/s per direction, latency in seconds."""
  bandwidth: float
  latency: float = 0.0

@dataclass(frozen=True)
class Device:
  """One accelerator (or one CPU node): dense FLOP/s per dtype, memory bandwidth (bytes/s), memory size (bytes)."""
  name: str
  flops: dict[str, float]
  bandwidth: float
  memory: float
  intra_link: Link | None = None  # between accelerators of one server, used for tensor parallelism when count > 1
  source: str = ""

  def flops_for(self, dtype: str) -> float:
    """Dense FLOP/s for `dtype`; a dtype the device lacks runs at the next wider one it has (fp8 on a GPU without fp8 -> fp16)."""
    key = "fp16" if dtype == "bf16" else dtype
    if key in self.flops: return self.flops[key]
    wider = [d for d in WIDER[WIDER.index(key) + 1:] if d in self.flops] if key in WIDER else []
    return self.flops[wider[0]] if wider else max(self.flops.values())

@dataclass(frozen=True)
class Model:
  """A transformer's shape. `params` counts every weight; `active_params` those one token uses (MoE: shared + routed experts).
  `kv_dim` is the number of elements cached per token per layer (GQA: 2·kv_heads·head_dim; MLA caches one latent instead);
  `attn_dim` the width that attention's quadratic term multiplies (heads·(qk_head_dim + v_head_dim))."""
  name: str
  params: float
  layers: int
  hidden: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: str = "fp16"
  kv_dtype: str = "fp16"
  active_params: float = 0.0  # 0: dense, = params
  experts: int = 0            # routed experts per MoE layer (0: dense)
  experts_active: int = 0     # routed experts each token uses
  dense_layers: int = 0       # MoE: leading layers with a dense MLP instead of experts (DeepSeek-V3: 3)
  kv_dim: int = 0             # 0: 2·kv_heads·head_dim
  attn_dim: int = 0           # 0: 2·heads·head_dim
  source: str = ""

  def __post_init__(self):
    if not self.active_params: object.__setattr__(self, "active_params", self.params)
    if not self.kv_dim: object.__setattr__(self, "kv_dim", 2 * self.kv_heads * self.head_dim)
    if not self.attn_dim: object.__setattr__(self, "attn_dim", 2 * self.heads * self.head_dim)

  @property
  def weight_bytes(self) -> float: return self.params * DTYPE_BYTES[self.dtype]
  @property
  def moe_layers(self) -> int: return self.layers - self.dense_layers if self.experts else 0
  @property
  def kv_bytes_per_token(self) -> float: return self.layers * self.kv_dim * DTYPE_BYTES[self.kv_dtype]

  def weights_touched(self, tokens: float) -> float:
    """Bytes of weights a step over `tokens` tokens reads. Dense: all of them. MoE: the shared part, plus each routed
    expert that at least one token picks (expected share 1 - (1 - k/E)^tokens with uniform routing)."""
    if not self.experts or tokens <= 0: return self.weight_bytes
    k, e = self.experts_active, self.experts
    routed = (self.params - self.active_params) * e / (e - k)  # total = shared + routed, active = shared + routed·k/E
    touched = 1 - (1 - k / e) ** max(tokens, 1)
    return (self.params - routed + routed * touched) * DTYPE_BYTES[self.dtype]

  def with_dtype(self, dtype: str) -> Model: return dataclasses.replace(self, dtype=dtype)

def _tf(**rates) -> dict[str, float]: return {k: v * T for k, v in rates.items()}

NVLINK5 = Link(900 * G, 2e-6)   # 1.8 TB/s bidirectional per GPU
NVLINK4 = Link(450 * G, 2e-6)   # 900 GB/s bidirectional per GPU
NVLINK6 = Link(1800 * G, 2e-6)  # 3.6 TB/s bidirectional per GPU
XGMI = Link(448 * G, 3e-6)      # 7 Infinity Fabric links x 64 GB/s per direction (896 GB/s aggregate bidirectional)
PCIE6 = Link(128 * G, 5e-6)     # PCIe 6.0 x16 per direction

DEVICES: dict[str, Device] = {d.name: d for d in [
  Device("b200", _tf(fp4=9000, fp8=4500, fp16=2250), 8000 * G, 180 * G, NVLINK5,
         "NVIDIA HGX/DGX B200 datasheet (1,000 W): dense FP4 9, FP8 4.5, FP16 2.25 PFLOP/s; 8 TB/s HBM3e; DGX B200 lists "
         "1,440 GB for 8 GPUs (180 GB usable of 192 GB per GPU); NVLink 5 1.8 TB/s bidirectional"),
  Device("a100", _tf(fp16=312), 2039 * G, 80 * G, Link(300 * G, 2e-6),
         "NVIDIA A100 80GB SXM datasheet: FP16/BF16 tensor 312 TFLOP/s dense (624 with sparsity), 2,039 GB/s HBM2e, 80 GB; "
         "NVLink 3 600 GB/s bidirectional per GPU"),
  Device("h100", _tf(fp8=1979, fp16=989), 3350 * G, 80 * G, NVLINK4,
         "NVIDIA H100 SXM5 datasheet: FP8 3,958 / FP16 1,979 TFLOP/s with sparsity (dense = half); 80 GB HBM3, 3.35 TB/s; NVLink 4 900 GB/s"),
  Device("h200", _tf(fp8=1979, fp16=989), 4800 * G, 141 * G, NVLINK4,
         "NVIDIA H200 SXM datasheet: same tensor rates as H100 (dense = half the sparse figures); 141 GB HBM3e, 4.8 TB/s; NVLink 4 900 GB/s"),
  Device("rubin-cpx", _tf(fp4=20000, fp8=10000, fp16=5000), 2000 * G, 128 * G, PCIE6,
         "NVIDIA Rubin CPX announcement (Sep 2025): 30 PFLOP/s NVFP4 (sparse), 128 GB GDDR7, PCIe 6, no NVLink; ~20 PFLOP/s dense FP4 and "
         "~2 TB/s GDDR7 as in docs/design.md; FP8 and FP16 derived as FP4/2 and FP4/4 (not published)"),
  Device("rubin", _tf(fp4=33300, fp8=16650, fp16=8325), 20500 * G, 288 * G, NVLINK6,
         "NVIDIA Vera Rubin announcements: 288 GB HBM4; 33.3 PFLOP/s dense FP4 and 20.5 TB/s as in docs/design.md; NVLink 6 3.6 TB/s "
         "bidirectional; FP8 and FP16 derived as FP4/2 and FP4/4 (not published)"),
  Device("dgx-spark", _tf(fp4=500, fp8=200, fp16=100), 273 * G, 128 * G, None,
         "NVIDIA DGX Spark (GB10): 1 PFLOP/s FP4 with sparsity (dense = half), 128 GB LPDDR5x at 273 GB/s; ~100 TFLOP/s FP16 from "
         "EXO's blog 'NVIDIA DGX Spark + Apple Mac Studio' (Oct 2025); FP8 derived as 2x FP16"),
  Device("m3-ultra", _tf(fp16=26, fp32=13), 819 * G, 512 * G, None,
         "Apple Mac Studio (M3 Ultra) tech specs: 819 GB/s, up to 512 GB unified memory; ~26 TFLOP/s FP16 from EXO's blog "
         "(Apple publishes no FLOP/s; FP32 assumed half); no FP8/FP4: those run at the FP16 rate"),
  Device("mi300x", _tf(fp8=2615, fp16=1307), 5300 * G, 192 * G, XGMI,
         "AMD Instinct MI300X datasheet: dense FP8 2,614.9 / FP16 1,307.4 TFLOP/s, 192 GB HBM3 at 5.3 TB/s, "
         "Infinity Fabric 896 GB/s aggregate peer bandwidth"),
  Device("mi308x", _tf(fp8=470, fp16=235), 5300 * G, 192 * G, XGMI,
         "AMD Instinct MI308X (China-market MI300 variant; no public AMD datasheet): 0.47 PFLOP/s FP8 and 5.3 TB/s as in docs/design.md, "
         "192 GB HBM3 and Infinity Fabric as MI300X; FP16 derived as FP8/2"),
  Device("wormhole-n300", _tf(fp8=466, fp16=131), 576 * G, 24 * G, Link(50 * G, 5e-6),
         "Tenstorrent Wormhole n300 specifications (docs.tenstorrent.com): 2 ASICs, 466 TFLOP/s FP8, 131 FP16, 24 GB GDDR6 "
         "at 576 GB/s; cards joined by 400 GbE (QSFP-DD)"),
  Device("cpu-node", _tf(fp16=29.5, fp32=14.7), 921.6 * G, 1536 * G, None,
         "generic many-core CPU node: 2x AMD EPYC 9654 (96 Zen 4 cores each, 2.4 GHz, AVX-512 with BF16), 24 channels DDR5-4800 "
         "(AMD spec: 460.8 GB/s per socket), 1.5 TB RAM; FLOP/s derived: 192 cores x 2.4 GHz x 32 FP32 FLOP/cycle, x2 for BF16"),
]}

MODELS: dict[str, Model] = {m.name: m for m in [
  Model("llama-3-8b", 8.03e9, 32, 4096, 32, 8, 128, source="Meta Llama 3 / 3.1 8B config.json (8.03 B parameters, GQA 32/8)"),
  Model("llama-3-70b", 70.6e9, 80, 8192, 64, 8, 128, source="Meta Llama 3 / 3.1 70B config.json (70.6 B parameters, GQA 64/8)"),
  Model("llama-3.1-405b", 405.9e9, 126, 16384, 128, 8, 128, source="Meta Llama 3.1 405B config.json"),
  Model("opt-13b", 12.85e9, 40, 5120, 40, 40, 128, source="facebook/opt-13b config.json (40 layers, hidden 5120, 40 heads, MHA; 12.85 B "
        "parameters); DistServe's 13B model"),
  Model("opt-66b", 65.7e9, 64, 9216, 72, 72, 128, source="facebook/opt-66b config.json (64 layers, hidden 9216, 72 heads, MHA; 65.7 B parameters)"),
  Model("smollm2-135m", 134.5e6, 30, 576, 9, 3, 64, source="HuggingFaceTB SmolLM2-135M config.json (tied embeddings)"),
  Model("deepseek-r1", 671e9, 61, 7168, 128, 128, 128, dtype="fp8", active_params=37e9, experts=256, experts_active=8, dense_layers=3,
        kv_dim=512 + 64, attn_dim=128 * (192 + 128),
        source="DeepSeek-V3/R1 config.json and paper (arXiv 2412.19437): 671 B total, 37 B active, FP8 weights, 61 layers (the first 3 "
               "dense), 256 routed experts (8 active) and 1 shared; MLA caches a 512-wide latent plus a 64-wide RoPE key per token per layer"),
  Model("mixtral-8x7b", 46.7e9, 32, 4096, 32, 8, 128, active_params=12.9e9, experts=8, experts_active=2,
        source="mistralai/Mixtral-8x7B-v0.1 config.json and paper (arXiv 2401.04088): 46.7 B total, 12.9 B active, 8 experts (2 active), GQA 32/8"),
  Model("mixtral-8x22b", 141e9, 56, 6144, 48, 8, 128, active_params=39e9, experts=8, experts_active=2,
        source="mistralai/Mixtral-8x22B-v0.1 config.json and announcement: 141 B total, 39 B active, 8 experts (2 active), GQA 48/8"),
  Model("qwen3-235b-a22b", 235e9, 94, 4096, 64, 4, 128, active_params=22e9, experts=128, experts_active=8,
        source="Qwen/Qwen3-235B-A22B config.json and Qwen3 report (arXiv 2505.09388): 235 B total, 22 B active, 128 experts (8 active), "
               "no shared expert, GQA 64/4, head_dim 128"),
  Model("qwen3-30b-a3b", 30.5e9, 48, 2048, 32, 4, 128, active_params=3.3e9, experts=128, experts_active=8,
        source="Qwen/Qwen3-30B-A3B config.json and Qwen3 report: 30.5 B total, 3.3 B active, 128 experts (8 active), GQA 32/4, head_dim 128"),
]}

MODEL_ALIASES = {"llama-3.1-8b": "llama-3-8b", "llama-3.1-70b": "llama-3-70b", "llama-3.3-70b": "llama-3-70b",
                 "smollm2": "smollm2-135m", "deepseek-r1-671b": "deepseek-r1", "deepseek-v3": "deepseek-r1",
                 "mixtral": "mixtral-8x7b", "qwen3-235b": "qwen3-235b-a22b", "qwen3-moe": "qwen3-235b-a22b", "qwen3-30b": "qwen3-30b-a3b"}
DEVICE_ALIASES = {"gb10": "dgx-spark", "n300": "wormhole-n300"}

class PlanError(ValueError):
  """A planner input a user can fix (unknown model or device, bad cluster file): the message names it and the fix."""

class ClusterFileError(PlanError):
  """A bad cluster file: names the file, the key, the problem and the fix."""
  def __init__(self, path: str, key: str, problem: str, fix: str):
    self.path, self.key, self.problem, self.fix = path, key, problem, fix
    super().__init__(f"cluster file {path}: {key}: {problem}. Fix: {fix}")

def find_device(name: str, extra: dict[str, Device] | None = None) -> Device:
  """A device by name: the cluster file's own first, then the catalog (aliases allowed)."""
  extra = extra or {}
  if name in extra: return extra[name]
  if (found := DEVICES.get(DEVICE_ALIASES.get(name, name))) is not None: return found
  raise PlanError(f"unknown device {name!r}: use one of {', '.join([*extra, *DEVICES])}, or define it in the cluster file as [devices.{name}]")

def find_model(name: str, extra: dict[str, Model] | None = None) -> Model:
  """A model shape by name: the cluster file's own first, then the catalog (aliases allowed, case-insensitive)."""
  extra = extra or {}
  if name in extra: return extra[name]
  key = name.lower()
  if (found := MODELS.get(MODEL_ALIASES.get(key, key))) is not None: return found
  raise PlanError(f"unknown model {name!r}: use one of {', '.join([*extra, *MODELS])} (or an alias: {', '.join(MODEL_ALIASES)}), "
                  f"or define it in the cluster file as [models.{name}]")
