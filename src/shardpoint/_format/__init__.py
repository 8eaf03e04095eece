"""On-disk formats: safetensors headers, the HF index, the shardpoint manifest."""
