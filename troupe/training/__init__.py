"""Training loops in plain torch, one rank at a time; the actors host them."""

from troupe.training.pretrain import PretrainConfig, PretrainWorker, TrainConfig

__all__ = ["PretrainConfig", "PretrainWorker", "TrainConfig"]
