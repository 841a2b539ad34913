"""The gpu_worker service: one per device (engine, memory pool, data plane, control commands)."""
import os

# UCX reads its global options when the library loads: ucxx sets UCX_MEMTYPE_CACHE, which this UCX
# build does not know, and warns about it at every start unless this is set before the first import.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
