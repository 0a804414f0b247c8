"""KV cache: layout (shapes and bytes), quantization, cache pools."""
