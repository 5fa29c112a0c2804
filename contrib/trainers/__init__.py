"""Adapters from rolloutd trajectories to RL trainers' rollout structures.

- :mod:`rolloutd.trainers.trl_adapter`: TRL ``GRPOTrainer(rollout_func=...)``
- :mod:`rolloutd.trainers.nemo_gym`: a NeMo-Gym agent server ``POST /run`` (NeMo-RL)
- :mod:`rolloutd.trainers.verl`: a verl ``AgentLoop``
- :mod:`rolloutd.trainers.skyrl`: a SkyRL ``Generator``

Every adapter keeps GRPO groups whole: unusable samples are resubmitted, then masked (loss
mask all 0, reward 0), never dropped (:mod:`rolloutd.trainers._common`). A harness-driven
rollout's segments become one row each where the trainer allows it (SkyRL step-wise), else its
last segment is the row and the count left out is recorded. See docs/training.md.
"""

#: Nothing at the package level: import the adapter you use (each pulls its trainer's
#: dependencies only when imported).
__all__: list[str] = []
