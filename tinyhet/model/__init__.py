"""The model: Llama config and forward pass (llama.py) on its layers (layers.py), GGUF-block weights (packed.py), loaders for
GGUF files and Hugging Face directories (weights.py), the tokenizer, sampling, the captured prefill (layer_jit.py), and a
model named by a path or random:... spec (spec.py).

May import: tinyhet.config, tinyhet.device, tinyhet.runtime, tinyhet.kernels."""
