"""Write arith_tiny.jsonl, the task of examples/arith_tiny.rlhf: add one to a digit.

Each line is {"prompt": "A plus 1", "answer": "A+1"} for A = 0..8 (answers 1..9, one digit each, every
answer once, so a policy that always gives the same answer scores 1/9 and only one that reads the prompt
scores more). Run it from anywhere: ``python examples/make_arith_data.py``.
"""

import json
import os

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arith_tiny.jsonl")


def lines() -> list[str]:
    """The file's lines, in order."""
    return [json.dumps({"prompt": f"{a} plus 1", "answer": str(a + 1)}) for a in range(9)]


if __name__ == "__main__":
    with open(OUT, "w", encoding="utf-8") as fh:
        fh.write("".join(line + "\n" for line in lines()))
    print(f"wrote {OUT}")
