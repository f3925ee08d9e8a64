"""Operations: running the pipeline on machines, not the pipeline itself. The pod entrypoint (`sdpipe pod`), the
Runpod commands (`sdpipe runpod`), the Slurm topology multi-node training reads, and `sdpipe doctor`."""
