"""The four RLHF roles in plain torch (``policy``, ``reference``, ``value``: reward model and
critic), the Ray actors that hold them and dispatch to them (``actors``), and the weight
groups between the policy and its rollout replicas (``topology``)."""
