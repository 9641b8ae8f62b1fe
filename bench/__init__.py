"""kvtier.bench: benchmarks behind ``kvtier bench ...``; each prints a figure beside its physical baseline."""
