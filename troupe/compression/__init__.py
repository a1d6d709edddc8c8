"""Model compression: ZeroQuant-style quantized Linear layers and whole-model quantization by
module-name patterns. (LKD and serving build on these; see issue 6.)"""

from troupe.compression.quantize import MODES, QuantizedLinear, quantize_model

__all__ = ["MODES", "QuantizedLinear", "quantize_model"]
