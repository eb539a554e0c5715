"""Training: the Trainer, optimizers, the optimizer step, checkpointer, FP8, the plan, Ray Train launch."""
