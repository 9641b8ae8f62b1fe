"""The KVTIER_* environment variables that are not config keys, each read by the module it steers (no Config
there). Named here, on the lowest floor (tests/test_layering.py), so that the host copies, the key table, the
RDMA device, the CUDA build and the owner tokens read theirs without importing kvtier.config, whose sections ask
the transports', policies' and offloads' tables (an import of the config from below made circles through them).
``ENV_NOT_CONFIG`` is what ``Config.from_env`` skips: kvtier.config's list of the same names (tests/test_config.py
checks they agree)."""

ENV_CONFIG_FILE = "KVTIER_CONFIG"  # names a file; not a config key itself
ENV_CACHE_DIR = "KVTIER_CACHE_DIR"  # where kernels/native_build.py caches the compiled CUDA library
ENV_CUDA_ARCH = "KVTIER_CUDA_ARCH"  # GPU architectures native_build.py compiles for when none is visible
ENV_NATIVE_CPU = "KVTIER_NATIVE_CPU"  # "0": memory/hostcopy.py and keys/table.py skip the native CPU library
ENV_RDMA_DEVICE = "KVTIER_RDMA_DEVICE"  # name[:port[:gid_index]]: the device kvtier/wire/verbs.py opens
ENV_ENGINE_PYTHON = "KVTIER_ENGINE_PYTHON"  # the real vLLM engine's python for bench/engine_proc.py (tests, bench)
ENV_RUNTIME_DIR = "KVTIER_RUNTIME_DIR"  # the directory of keyless daemons' owner tokens (kvtier/auth/owner.py)
ENV_NOT_CONFIG = frozenset({ENV_CONFIG_FILE, ENV_CACHE_DIR, ENV_CUDA_ARCH, ENV_NATIVE_CPU, ENV_RDMA_DEVICE,
                            ENV_ENGINE_PYTHON, ENV_RUNTIME_DIR})
