"""The Ray actor that hosts a model — one per rank of a worker group — whatever its backend and engine.

* ``base``        ``ModelWorker``: holds one train backend (``rlhfc.runtime.train.backend``) and one rollout
                  engine (``rlhfc.runtime.rollout.base``) and does what every backend shares: generation,
                  forwards, training, weights and their transfers, checkpoints.
* ``dispatch``    how each worker method runs on a group of ranks, declared on the method (``@dispatch``).
* ``stages``      the stage-call decorator: torch threads per call, timed spans.
* ``trace``       measured spans of worker calls, and the run's timeline (``--trace``).
* ``allocator``   a CPU worker keeps the memory a step frees.
"""
