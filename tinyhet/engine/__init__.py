"""The engines: the scheduler, prefill and its client (prefill.py, client.py), the one jitted paged decode step
(decode_engine.py) that the decode node (decode_node.py), the single-device engine (local_engine.py) and `bench decode` run.

May import: tinyhet.config, tinyhet.device, tinyhet.model, tinyhet.kv, tinyhet.runtime, tinyhet.kernels."""
