"""Reinforcement learning on Ray: rollout actors, DDP learners, weight sync, the RL loop."""
