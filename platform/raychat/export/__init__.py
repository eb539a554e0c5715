"""Hugging Face export of a checkpoint (Qwen3 layout): `raychat export`."""
