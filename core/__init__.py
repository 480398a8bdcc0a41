"""What every experiment needs and nothing paper-specific: config, mesh, model, data, training, checkpoints."""
