"""An example reward module: a program in this folder names its function as rule("my_rewards:exact_match", roll).

A rule's module is a .py file beside the program (or rlhfc's built-in rewards, or an installed module
listed in the run block's reward_modules); see docs/language.md, section rule().
"""


def exact_match(prompt: str, response: str) -> float:
    """1.0 when the response repeats the prompt exactly, else 0.0."""
    return float(response.strip() == prompt.strip())
