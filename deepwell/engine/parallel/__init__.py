"""Model parallelism on torch.distributed (gloo on CPU, NCCL on CUDA): mirror context
parallelism for long DeepSeek-V4.1 prefills (context*.py)."""
