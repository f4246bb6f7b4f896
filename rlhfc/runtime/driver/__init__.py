"""The driver's rooms around the step loop (``rlhfc.runtime.job``).

* ``cluster``     Ray start-up, the placement group, each worker group's ranks holding its backend.
* ``group``       ``WorkerGroup``: the handle ``w.<worker>`` the generated step calls (the job's ``sync`` and
                  ``reshard`` move weights between and within groups).
* ``checkpoint``  save / resume / latest, atomically, and the manifest checks.
* ``metrics``     ``metrics.jsonl``, TensorBoard, the progress line, the summary.
* ``samples``     ``samples.jsonl`` and TensorBoard text.
* ``hygiene``     Ray's workers run the driver's rlhfc; nothing left behind.
* ``export``      a checkpoint's model as a Hugging Face folder (``rlhfc export``).
"""
