"""Qwen2-MoE (`model_type: qwen2_moe`): `spec.py` (config, weights, KV cache) and `model.py`."""
