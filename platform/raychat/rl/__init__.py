"""Reinforcement learning on Ray: rollout actors, a data-parallel learner, masked policy gradients, weight sync.
Its configuration is raychat.config.RLConfig.

raychat.rl.objective  group_advantages, collate, token_logprobs, per_token_loss, normalized_loss, pass_at_k
raychat.rl.rollout    RolloutWorker / RolloutActor (ModelRunner; G samples per prompt; Task.reward; version tag)
raychat.rl.learner    Learner / LearnerActor (DDP when > 1; the trainer's optimizer step and checkpointer)
raychat.rl.weights    weights_hash, publish / load_published (object store), collective broadcast
raychat.rl.topology   Topology (placement group, learner and rollout actors)
raychat.rl.sync       WeightSync (publish, acks, re-sync of a restarted actor)
raychat.rl.scheduler  RolloutScheduler (prompts per step, chunks, re-issue after a fault, pass@k eval)
raychat.rl.loop       RLRun (the sync / async loop, checkpoints, resume)
raychat.rl.cli        the `raychat rl` command
"""
