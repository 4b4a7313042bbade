"""Node math, parallel layouts and rank maps: RunConfig -> JobPlan."""

from .job_plan import JobPlan, RolePlan, build_plan

__all__ = ["JobPlan", "RolePlan", "build_plan"]
