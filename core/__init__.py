"""What every experiment needs and nothing paper-specific: config, mesh, model, data, training, checkpoints.

Importing it (or any package of this project) changes nothing process-wide. The CPU memory settings the project's
commands apply (`core.host_memory.keep_freed_memory`) are a program's choice: call it before the first computation."""
