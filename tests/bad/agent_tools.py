"""Tools the bad tool programs (tests/bad/tool_*.rlhf) name."""

TABLE = {"a": 1}


def calculator(text):
    return text


def two_args(text, other):
    return text + other


class Game:
    pass
