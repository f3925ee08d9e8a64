"""Pipeline stages: each module defines INPUTS, OUTPUTS and run(cfg, inputs, outputs), called by `sdpipe <stage>`."""
