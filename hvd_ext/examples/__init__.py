"""Small reference workloads used by the main job, the tests and the benchmarks."""
