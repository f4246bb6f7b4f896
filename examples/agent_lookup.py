"""The environment of examples/agent_tiny.rlhf: each prompt is a key ("kqzt") whose value, one digit, is not in
the prompt — the data record holds it (field `answer`), and the environment tells it when asked.

A turn that is "?" looks the key up: the environment answers with the value. Any other turn is the answer and
ends the episode: 1.0 when it is the value; 0.2 when it is a wrong digit given after looking up (a well-formed
attempt); else 0. The keys are
random and each is seen about once in training, so a policy cannot learn the values by heart: it scores by
learning to look up and then copy what it was told.
"""


class Lookup:
    def reset(self, record):
        self.value = str(record["answer"])
        self.looked = False
        return ""

    def step(self, action):
        if action == "?" and not self.looked:
            self.looked = True
            return self.value, 0.0, False
        answer = action.strip()
        if not self.looked:   # an answer counts only when it was looked up
            return "", 0.0, True
        return "", 1.0 if answer == self.value else 0.05 if len(answer) == 1 and answer.isdigit() else 0.0, True
