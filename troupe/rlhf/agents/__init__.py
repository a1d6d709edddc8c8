"""Multi-turn (agentic) rollouts: the loop that interleaves generation with environment turns
(``loop``), the environments in the sandbox (``environments``), and the recording
OpenAI-compatible server an external agent drives (``server``)."""
