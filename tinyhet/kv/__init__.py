"""The KV cache: block bookkeeping (block_manager.py), the paged cache over per-layer pools (paged_cache.py), the sender that
streams a prefill's layers into a decode node's blocks (sender.py), and the landing notices that say a layer arrived
(notices.py).

May import: tinyhet.config, tinyhet.device, tinyhet.model, tinyhet.runtime, tinyhet.kernels."""
