"""The Ray actors that host a model — one per rank of a worker group — by train backend.

* ``base``        ``ModelWorker``: one process (the ``torch`` backend), and what every backend shares:
                  generation through the worker's rollout engine, forwards, training, weights, checkpoints.
* ``fsdp``        data-parallel ranks sharded with FSDP2 (the ``fsdp`` backend).
* ``megatron``    dp x tp x pp megatron-core ranks (the ``megatron`` backend).
* ``collective``  the collective weight transfer of a ``sync`` stage.
* ``stages``      the stage-call decorator: torch threads per call, timed spans.
* ``trace``       measured spans of worker calls, and the run's timeline (``--trace``).
* ``allocator``   a CPU worker keeps the memory a step frees.

Which class a group runs is its backend's registration (``rlhfc.contract.engines``).
"""
