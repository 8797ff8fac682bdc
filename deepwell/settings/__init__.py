"""Every setting of the engine in one torch-free place: the typed declarations
(`engine.EngineArgs`, `parallel.ParallelConfig`), the environment variables that set them
(`environment`) and the command-line flags generated from them (`flags`).

Torch-free so the HTTP process and `deepwell --help` read them without loading the engine.
"""
