"""A rollout actor holding weights older than a chunk's min_version (restarted: version 0) generates nothing;
the dispatcher counts the chunk (stale_chunks) and its samples (dropped_samples), re-syncs the actor and issues
the chunk again (raychat.rl.dispatcher, no Ray)."""

from support.rl_fixtures import rl_config, tiny_checkpoint

from raychat.rl.dispatcher import RolloutDispatcher
from raychat.rl.loop import rl_tasks
from raychat.rl.rollout import RolloutWorker


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn, args


class _Group:
    """An ActorGroup of one rollout actor, called in this process: a call's "ref" is (method, args)."""

    learners = []

    def __init__(self, worker: RolloutWorker):
        self.rollouts = [
            type("Actor", (), {"rollout": _Remote(worker.rollout), "evaluate": _Remote(worker.evaluate)})
        ]

    def option(self, name: str) -> str:
        return "--" + name.replace("_", "-")

    def wait_for(self, refs, names, call, timeout_s, budget, fix):
        return [fn(*args) for fn, args in refs]


class _Sync:
    ahead = None

    def __init__(self, worker: RolloutWorker):
        self.worker = worker

    def resync(self, w: int, version: int) -> bool:
        self.worker.version = version
        return True


def test_a_chunk_refused_by_a_restarted_actor_counts_its_samples_dropped(tmp_path, small_tokenizer):
    """Step 3's chunk of 2 prompts x 2 samples on an actor of version 0: it refused before generating, so the
    dropped samples were counted from its (empty) result: always 0, and the line said "0 samples dropped"."""
    ckpt = tiny_checkpoint(tmp_path / "ck", small_tokenizer)
    cfg = rl_config(checkpoint=ckpt, task_examples=64, max_operand=9, prompts_per_step=2, samples_per_prompt=2,
                    max_tokens=4, rollout_workers=1, eval_examples=2, eval_samples=2)  # fmt: skip
    worker = RolloutWorker(ckpt, rl_tasks(cfg))
    assert worker.version == 0
    lines = []
    dispatcher = RolloutDispatcher(cfg, _Group(worker), _Sync(worker), 64, log=lines.append)
    dispatcher.version = 3
    (result,) = dispatcher.collect(dispatcher.submit(3))
    assert [s["version"] for s in result["samples"]] == [3, 3, 3, 3]
    assert (dispatcher.stale_chunks, dispatcher.dropped_samples) == (1, 4)
    assert lines == [
        "rollout actor 0 held version 0 < 3 (restarted?): 4 samples dropped; re-syncing it to version 3 and "
        "re-issuing its prompts"
    ]
