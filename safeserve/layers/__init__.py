"""Building blocks the model families share: norms, rotary embeddings, attention over the paged
KV cache, dense MLPs and the MoE block (router configuration, shared experts)."""
