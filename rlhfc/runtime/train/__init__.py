"""Training: the train-backend interface and its backends, the minibatch loop, packing by length.

* ``backend``   ``TrainBackend``: how one rank holds, computes with, trains and saves a worker's model; the
                one-process ``torch`` backend; ``build_backend`` from the registry; row shares and rendezvous.
* ``fsdp``      data-parallel ranks sharded with FSDP2 (the ``fsdp`` backend).
* ``megatron``  dp x tp x pp megatron-core ranks (the ``megatron`` backend).
* ``loop``      ``train_epochs``, the optimizer, and the actor / critic loss functions on a model.
* ``packing``   rows grouped by length, each group cut to its own width (forwards and training).

Which backend a worker holds is the plan's trainer name, registered in ``rlhfc.contract.engines``.
"""
