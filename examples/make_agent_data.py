"""Write examples/agent_tiny.jsonl: 2000 random four-letter keys ("k" and three letters), each with a random
digit as its value (field `answer`), which only the environment (agent_lookup.py) knows how to find.

    python examples/make_agent_data.py
"""

import json
import os
import random

rng = random.Random(0)
letters = "abcdefghijklmnopqrstuvwxyz"
keys = set()
while len(keys) < 2000:
    keys.add("k" + "".join(rng.choice(letters) for _ in range(3)))
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent_tiny.jsonl")
with open(path, "w") as fh:
    for key in sorted(keys, key=lambda _: rng.random()):
        fh.write(json.dumps({"prompt": key, "answer": str(rng.randrange(10))}) + "\n")
