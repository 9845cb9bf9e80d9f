"""`safeserve bench`: offline, in-process decode benchmark against the memory floor.

For each concurrency B the bench prefills B prompts of `--input-len` random tokens, then decodes
`--output-len` tokens for all of them in lock-step through the engine's own `ModelRunner` (the
same forward, kernels, CUDA graphs and sampler as `serve`). Each decode step's bytes are what it
must read from memory: the dense weights, the experts the step's routing actually selected in
each MoE layer (read from the router outputs of that very step), and the KV cache of every
sequence. Bytes over the HBM read ceiling, which the bench measures at start (a large bf16 sum),
give the floor; step time over floor says how close to the hardware a step runs.

`--peer transformers` runs Hugging Face transformers' own model of the same config on the same
prompts, in the same process, as the side-by-side.
"""

from __future__ import annotations

from safeserve.bench.engine import make_prompts
from safeserve.bench.options import add_bench_args
from safeserve.bench.run import main

__all__ = ["add_bench_args", "main", "make_prompts"]
