"""Build glue that pyproject.toml cannot express: the folder -> package mapping and the native CPU copy library.

One import name, several top-level folders: the two daemons, the engine adapters and the benchmarks each
live in a room of their own (master/, pool/, connectors/, bench/) but import as kvtier.master, kvtier.pool,
kvtier.connectors and kvtier.bench, so users see one package and one version. The daemons sit beside the
client library (kvtier/), not inside it: they share with it only kvtier.wire and the library rooms
(tests/test_layering.py).
"""

from setuptools import Extension, find_packages, setup

ROOTS = {
    "kvtier": "kvtier",
    "kvtier.master": "master",
    "kvtier.pool": "pool",
    "kvtier.connectors": "connectors",
    "kvtier.bench": "bench",
}
# The CUDA sources travel in the wheel (nvcc builds them on the user's machine on first use, native_build.py):
# native/cuda is the data-only package kvtier._cuda_src (its files: pyproject.toml's package-data).
NATIVE_SRC = {"kvtier._cuda_src": "native/cuda"}

packages: list[str] = [*NATIVE_SRC]
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

# A plain C shared library (no Python API), loaded with ctypes: the same calling convention as the CUDA
# launchers in native/cuda, and nothing that ties it to one Python or torch build.
native_cpu = Extension(
    "kvtier._native_cpu",
    sources=["native/cpu/memcopy.c", "native/cpu/keytable.c"],
    extra_compile_args=["-O3", "-std=c11", "-fvisibility=hidden"],
    extra_link_args=["-lpthread"],
)

setup(
    packages=packages,
    package_dir={**ROOTS, **NATIVE_SRC},
    ext_modules=[native_cpu],
    include_package_data=True,
)
