# Training: `accelerate launch` with one process per GPU the rule holds. Checkpoints under results/train/checkpoints
# are not outputs, so they survive a rerun and `train.resume: latest` picks up after a crash.


rule train:
    input:
        index=rules.latents.output.index,
        model=model_files,
    output:
        summary="results/train/summary.json",
        final=directory("results/train/final"),
        metrics="results/train/metrics.csv",
    log:
        "logs/train.log",
    benchmark:
        "benchmarks/train.tsv"
    conda:
        "../envs/sdpipe.yaml"
    resources:
        gpu=train_gpus(),
    params:
        config=RESOLVED_CONFIG,
        out=lambda wildcards, output: str(Path(output.summary).parent),
        procs=train_processes(),
        # On a cluster, profiles/slurm sets the `mpi` resource to an srun that starts one `sdpipe train` per node.
        launcher=lambda wildcards, resources: getattr(resources, "mpi", ""),
        model=use_model,
        settings=settings_of("train"),
    shell:
        "{params.launcher} sdpipe train --config {params.config:q} {params.model:q} --set train.num_processes={params.procs:q} "
        "--index {input.index:q} --out {params.out:q} --summary {output.summary:q} > {log:q} 2>&1"
