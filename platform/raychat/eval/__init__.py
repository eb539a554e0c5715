"""Evaluation: bits per byte, samples, task accuracy."""
