"""Replay forensics: per-step records of what each rank trained on, rebuilt from the data and checked."""
