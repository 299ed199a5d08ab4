"""tinygrad kernels for the decode node (paged attention) and KV packing; installed as tinyhet.kernels."""
