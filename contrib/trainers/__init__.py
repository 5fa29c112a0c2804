"""Adapters from rolloutd trajectories to RL trainers' rollout structures.

- :mod:`contrib.trainers.trl_adapter`: TRL ``GRPOTrainer(rollout_func=...)``
- :mod:`contrib.trainers.nemo_gym`: a NeMo-Gym agent server ``POST /run`` (NeMo-RL)
- :mod:`contrib.trainers.verl`: a verl ``AgentLoop``
- :mod:`contrib.trainers.skyrl`: a SkyRL ``Generator``

Every adapter keeps GRPO groups whole: unusable samples are resubmitted, then masked (loss
mask all 0, reward 0), never dropped (:mod:`contrib.trainers._common`). See docs/training.md.
"""
