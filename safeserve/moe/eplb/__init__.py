"""Expert-parallel load balancing: the loads it records (recorder, distribution files), how even
they are (balancedness) and where physical experts go (algorithm)."""
