"""Scale-out on torch.distributed: attention data parallelism (a rank per EngineCore), MoE
expert parallelism (all-to-all per MoE layer), EPLB, and the launch of local ranks."""

from deepwell.engine.parallel.group import ParallelConfig, ParallelError
