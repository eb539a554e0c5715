"""raychat.train.worker: Ray Train's per-report INFO line is left out of a run's log, its warnings are not."""

import logging

import pytest
from ray.train.v2._internal.execution import context as ray_train_context

from raychat.train.worker import quiet_ray_train_reports


@pytest.fixture
def reports_logger():
    """The logger Ray Train's report() writes "Reporting training result N: ..." to, its level restored after."""
    logger = ray_train_context.logger
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_ray_trains_report_line_is_left_out_and_its_warnings_kept(reports_logger, caplog):
    caplog.set_level(logging.INFO)  # the root logger at INFO, as on a Ray Train worker
    reports_logger.info("Reporting training result 1: TrainingReport(...)")
    assert [r.getMessage() for r in caplog.records] == ["Reporting training result 1: TrainingReport(...)"]
    caplog.clear()
    quiet_ray_train_reports()
    reports_logger.info("Reporting training result 2: TrainingReport(...)")
    reports_logger.warning("Checkpoint upload for checkpoint_000002 has been running for 60s")
    assert [r.getMessage() for r in caplog.records] == [
        "Checkpoint upload for checkpoint_000002 has been running for 60s"
    ]
