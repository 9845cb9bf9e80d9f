"""DeepSeek-V3 (`model_type: deepseek_v3`, `DeepseekV3ForCausalLM`; also Kimi K2 and Moonlight):
multi-head latent attention (one compressed latent vector per token in the KV cache), dense
layers before `first_k_dense_replace`, then MoE layers with shared experts and sigmoid routing
restricted to the best expert groups and steered by `e_score_correction_bias`. `spec.py`
(config, weights, KV cache) and `model.py`."""
