"""Pure tensor functions, each with a torch/CPU path and a cupy path for CUDA tensors."""
