"""A role's model and its training: the language model with the heads RLHF needs (``lm``: token
log-probabilities, a value head), and how a role builds it from the recipe and trains it under
ZeRO-1 or ZeRO-3 (``build``: ``build_lm``, ``Trainable``, ``PartitionedTrainable``)."""
