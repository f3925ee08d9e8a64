"""`sdpipe bench`: GPU speed against a plain baseline measured in the same run (issue 5).

baseline: the diffusers text-to-image example's loop; parity: the optimised step computes the baseline's loss and
weights; pipeline: the project's own stages (latents, train) and the training data loader, timed as users run
them; cli: the command, its table and its JSON.
"""
