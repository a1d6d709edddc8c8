"""Parallelism applied to plain models after construction, and the layouts of the groups it
uses. Models take no process groups (docs/architecture.md, "The layers")."""

from troupe.parallel.expert import apply_expert_parallel
from troupe.parallel.layout import ExpertLayout, expert_layout
from troupe.parallel.partition import PartitionedBucket
from troupe.parallel.tensor import apply_tensor_parallel, full_state_dict
from troupe.parallel.zero3 import Zero3

__all__ = ["ExpertLayout", "PartitionedBucket", "Zero3", "apply_expert_parallel",
           "apply_tensor_parallel", "expert_layout", "full_state_dict"]
