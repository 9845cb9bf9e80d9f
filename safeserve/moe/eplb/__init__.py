"""Expert-parallel load balancing: the load statistics (balancedness) it acts on."""
