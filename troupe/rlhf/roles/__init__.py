"""The four RLHF roles in plain torch (``policy``, ``reference``, ``value``: reward model and
critic), the Ray actors that hold them and dispatch to them (``actors``), and the weight
groups between the policy and its rollout replicas (``topology``).

Each role object is one data-parallel rank of its role: tensors that arrive are this rank's
slice of the batch, and gradient averaging happens in its optimizer. Each computes on
``worker_device(cfg.device)`` (its Ray GPU, or the CPU): its model lives there, and so do the
batches it tokenizes itself; tensors handed to it arrive there through the actors."""
