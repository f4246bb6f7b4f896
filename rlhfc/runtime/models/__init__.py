"""Models as a worker holds them: built from the plan's spec, and what changes how they compute.

* ``build``             a policy / value / score model from a spec (seeded random or a local Hugging Face
                        folder); weights in and out.
* ``lora``              LoRA adapters through peft.
* ``precision``         bf16 autocast of forwards (``run { precision = bf16 }``).
* ``recompute``         the plan's activation recomputation, applied to the transformer blocks.
* ``megatron``          megatron-core's ``GPTModel`` for a spec, and what running it on a CPU needs.
* ``megatron_convert``  weights between the Hugging Face layout and megatron-core's.
"""
