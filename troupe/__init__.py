"""troupe: an actor-based runtime on Ray for large-model training, RLHF and quantized serving."""

from troupe.runtime.cluster import ClusterInfo, init, shutdown

__all__ = ["ClusterInfo", "init", "shutdown", "__version__"]
__version__ = "0.1.0"
