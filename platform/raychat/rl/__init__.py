"""Reinforcement learning on Ray: rollout actors, a data-parallel learner, masked policy gradients, weight sync.

raychat.rl.config     RLConfig (dataclass; YAML; one --flag per field)
raychat.rl.objective  group_advantages, collate, token_logprobs, per_token_loss, normalized_loss, pass_at_k
raychat.rl.rollout    RolloutWorker / RolloutActor (ModelRunner; G samples per prompt; Task.reward; version tag)
raychat.rl.learner    Learner / LearnerActor (torch.distributed group when > 1; optimizer step; checkpoints)
raychat.rl.weights    weights_hash, publish / load_published (object store), collective broadcast
raychat.rl.loop       RLRun (sync / async loop, eval pass@k, faults, resume) and the `raychat rl` command
"""
