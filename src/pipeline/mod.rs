//! Pipelines and the scheduler.
