"""The tool of tests/e2e/agent_tool.rlhf: named "a", so a tiny random policy whose one-token turn is "a" calls it."""


def bee(text):
    return "bc"
