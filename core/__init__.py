"""What every experiment needs and nothing paper-specific: config, mesh, model, data, training, checkpoints.

Importing it keeps XLA:CPU's per-execution buffers in memory the process holds (`core.host_memory`: single-device
programs dispatched on the calling thread, two glibc malloc options)."""

from core import host_memory as _host_memory

_host_memory.keep_freed_memory()
