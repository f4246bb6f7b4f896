"""Generation: the rollout-engine interface and its engines, and the forwards that score a rollout.

* ``base``        :class:`RolloutEngine` (what a worker decodes through), the torch decoder behind it, and
                  :func:`build_rollout` (the engine the plan names, from ``rlhfc.contract.engines``).
* ``decoding``    the torch engine's KV-cached decode loop (``generate_stream``).
* ``sampling``    temperature, top-k, top-p and per-row random streams.
* ``generation``  rollout batches and the forwards over them (log-probs, values, scores, entropy).
* ``vllm``        the vLLM engine (``run { rollout = vllm }``).
"""
