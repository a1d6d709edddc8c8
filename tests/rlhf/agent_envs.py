"""Environments the multi-turn tests name (imported by troupe's sandboxed environment processes
from the repository root: `env.function=tests.rlhf.agent_envs:NAME`)."""


class Retry:
    """Asks once more after the first answer; the second answer is rewarded by how many
    different characters it has (a reward that varies between samples, for a tiny model that
    cannot do a real task). A prompt holding "!" makes the environment raise in its step."""

    def reset(self, row):
        self.turn, self.prompt = 0, row["prompt"]
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages, assistant):
        self.turn += 1
        if "!" in self.prompt:
            raise RuntimeError("this environment breaks on '!'")
        if self.turn == 1:
            return [{"role": "user", "content": "again"}], None, False
        return [], float(len(set(assistant["content"] or ""))), True
