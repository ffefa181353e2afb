"""The engine: loop, scheduler, block pool, executor, CUDA graphs, sampler, hidden rows, and the
engine process. Knows nothing of Triton."""
