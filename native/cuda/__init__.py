"""kvtier._cuda_src: the CUDA kernel sources, shipped in the wheel as package data (no Python code here).

nvcc compiles them on the user's machine on first use (kvtier/kernels/native_build.py), so an installed kvtier needs
them at run time; setup.py maps this folder to ``kvtier._cuda_src``.
"""
