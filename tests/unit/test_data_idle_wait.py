"""raychat.data.loader.pipeline.IdleWait: Ray Data's scheduling loop sleeps only in a step with no task in flight."""

from types import SimpleNamespace

from raychat.data.loader import pipeline


class Op:
    def __init__(self, active: int):
        self.active = active

    def num_active_tasks(self) -> int:
        return self.active


def test_idle_wait_sleeps_only_when_no_operator_has_a_task_in_flight(monkeypatch):
    slept = []
    monkeypatch.setattr(pipeline.time, "sleep", slept.append)
    wait = pipeline.IdleWait()
    wait.on_execution_step(SimpleNamespace(_topology={Op(0): None, Op(2): None}))
    assert slept == []  # a task runs: the loop blocks in ray.wait, no sleep added
    wait.on_execution_step(SimpleNamespace(_topology={Op(0): None, Op(0): None}))
    assert slept == [pipeline.IDLE_WAIT_S] == [0.05]
