"""Model compression: ZeroQuant-style quantized Linear layers, whole-model quantization by
module-name patterns, and layer-by-layer knowledge distillation (LKD)."""

from troupe.compression.lkd import FakeQuantLinear, layerwise_distill, random_batches
from troupe.compression.quantize import (MODES, QuantizedLinear, quantize_for, quantize_model,
                                         requantize)

__all__ = ["MODES", "FakeQuantLinear", "QuantizedLinear", "layerwise_distill", "quantize_for",
           "quantize_model", "random_batches", "requantize"]
