"""Scale-out on torch.distributed (gloo on CPU, NCCL on CUDA): attention data parallelism
(a rank per EngineCore), MoE expert parallelism (all-to-all per MoE layer), EPLB, the launch
of local ranks, and mirror context parallelism for long DeepSeek-V4.1 prefills (context*.py)."""

from deepwell.engine.parallel.group import ParallelConfig, ParallelError
