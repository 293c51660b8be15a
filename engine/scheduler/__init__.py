"""Scheduling: who runs this step, with how many tokens."""

from engine.scheduler.output import (
    EngineCoreOutputs,
    ModelRunnerOutput,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
)
from engine.scheduler.scheduler import Scheduler

__all__ = [
    "EngineCoreOutputs",
    "ModelRunnerOutput",
    "RequestUpdate",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
]
