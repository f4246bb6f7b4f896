"""Training: the minibatch loop every train backend runs, and packing an unpadded batch by length.

* ``loop``     ``train_epochs``, the optimizer, and the actor / critic loss functions on a model.
* ``packing``  rows grouped by length, each group cut to its own width (forwards and training).
"""
