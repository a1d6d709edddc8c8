"""Environments the multi-turn tests name (imported by troupe's sandboxed environment processes
from the repository root: `env.function=tests.rlhf.agent_envs:NAME`)."""

import os
import time


class Retry:
    """Asks once more after the first answer; the second answer is rewarded by how many
    different characters it has (a reward that varies between samples, for a tiny model that
    cannot do a real task). A prompt holding "!" makes the environment raise in its step, "~"
    hang, "%" kill its process and "^" allocate past any memory limit."""

    def reset(self, row):
        self.turn, self.prompt = 0, row["prompt"]
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages, assistant):
        self.turn += 1
        if "!" in self.prompt:
            raise RuntimeError("this environment breaks on '!'")
        if "~" in self.prompt:
            time.sleep(60)
        if "%" in self.prompt:
            os._exit(9)
        if "^" in self.prompt:
            self.hoard = bytearray(8 << 30)
        if self.turn == 1:
            return [{"role": "user", "content": "again"}], None, False
        return [], float(len(set(assistant["content"] or ""))), True
