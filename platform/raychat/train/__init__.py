"""Training: configuration, optimizers, FP8, the Ray Train loop and its entrypoints."""
