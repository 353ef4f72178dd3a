"""The repository as a whole: the layering, the docs' code blocks, the benchmarks."""
