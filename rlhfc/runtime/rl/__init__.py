"""The RL math on plain tensors, imported by the driver's compute stages and the training loop.

* ``ppo``         masked reductions, KL, GAE, group advantages, PPO's policy and value losses and their
                  aggregation.
* ``algorithms``  the family beyond PPO: REINFORCE++, ReMax, DAPO's filters and overlong penalty, GSPO,
                  learning-rate schedules, the rollout/trainer log-prob gap (TIS).
* ``guards``      the errors a stage raises on a non-finite value.
* ``refill``      DAPO's dynamic sampling with refill (rounds until enough informative groups).
"""
