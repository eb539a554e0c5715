"""Evaluation: bits per byte, greedy samples, task accuracy, and `raychat eval`."""
