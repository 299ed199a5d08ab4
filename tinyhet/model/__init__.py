"""The model: Llama config and forward pass (llama.py) on its layers (layers.py), GGUF-block weights (packed.py) and bfloat16
ones (bf16_weight.py), loaders for GGUF files and Hugging Face directories (weights.py over gguf_loader.py, hf_loader.py and
model_files.py), the tokenizer, sampling, the captured prefill (layer_jit.py), and a model named by a path or random:... spec
(spec.py).

May import: tinyhet.config, tinyhet.device, tinyhet.runtime, tinyhet.kernels."""
