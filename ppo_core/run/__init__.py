"""Running and distributing a job: processes and roles, rollout workers, checkpoints, the run directory and
its logs, tracking, the memory planner (`ppo-plan`) and the run's precision."""
