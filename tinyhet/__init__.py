"""tinyhet: one LLM across unlike machines. Prefill on a compute-dense accelerator (device HET), decode on a big-memory
CPU node (device MESH), KV cache streamed between them layer by layer over RDMA, TCP or shared memory."""
from tinyhet.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config"]
__version__ = "0.1.0"
