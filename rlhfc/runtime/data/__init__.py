"""What flows into and between stages: prompts, tokens and the runtime values of the IR's types.

* ``prompts``    prompt sources (synthetic task, JSONL, tables) with a checkpointable cursor.
* ``tokenizer``  the built-in character tokenizer and a Hugging Face wrapper.
* ``values``     one class per IR value type (``Rollout``, ``TokenValues``, the loss inputs).
* ``answers``    final answers out of responses, for verifiable rewards.
"""
