"""The tinygrad backend: devices HET and MESH (backend.py), the node's registered memory (memory.py), the CPU worker pool's
hookup into tinygrad (cpu_threads.py), and the host buffers a GPU's layers leave through (gpu_staging.py).

May import: tinyhet.config, tinyhet.runtime, tinyhet.kernels."""
