# The data half of the DAG: raw images -> manifest -> captions -> latent and text-embedding cache.
# Each stage is incremental on its own (content-addressed caches), so a rerun triggered by a touched file or a
# DVC checkout costs a scan, not a recomputation.


if DREAMBOOTH:

    rule class_images:
        input:
            model=base_model_files,
        output:
            summary="results/class_images/summary.json",
        log:
            "logs/class_images.log",
        benchmark:
            "benchmarks/class_images.tsv"
        conda:
            "../envs/sdpipe.yaml"
        resources:
            gpu=gpus_for("dreambooth"),
        params:
            config=RESOLVED_CONFIG,
            model=use_model,
            images=CLASS_IMAGES,
            settings=settings_of("class_images"),
        shell:
            "sdpipe class-images --config {params.config:q} {params.model:q} --set dreambooth.gpus={resources.gpu:q} "
            "--images {params.images:q} --summary {output.summary:q} > {log:q} 2>&1"


rule prepare:
    input:
        unpack(class_images),
        raw=raw_files,
        regularisation=regularisation_files,
    output:
        manifest="results/prepare/manifest.jsonl",
        rejected="results/prepare/rejected.jsonl",
        summary="results/prepare/summary.json",
    log:
        "logs/prepare.log",
    benchmark:
        "benchmarks/prepare.tsv"
    conda:
        "../envs/sdpipe.yaml"
    params:
        config=RESOLVED_CONFIG,
        settings=settings_of("prepare"),
        class_images=CLASS_IMAGES,
        raw=use_raw_dir,
        raw_state=raw_state,
    shell:
        "sdpipe prepare --config {params.config:q} {params.raw:q} --class-images {params.class_images:q} --manifest {output.manifest:q} "
        "--rejected {output.rejected:q} --summary {output.summary:q} > {log:q} 2>&1"


rule caption:
    input:
        manifest=rules.prepare.output.manifest,
        raw=raw_files,
    output:
        captions="results/captions/captions.jsonl",
        summary="results/captions/summary.json",
    log:
        "logs/caption.log",
    benchmark:
        "benchmarks/caption.tsv"
    conda:
        "../envs/sdpipe.yaml"
    resources:
        gpu=gpus_for("caption"),
    params:
        config=RESOLVED_CONFIG,
        settings=settings_of("caption"),
        raw=use_raw_dir,
    shell:
        "sdpipe caption --config {params.config:q} {params.raw:q} --set caption.gpus={resources.gpu:q} "
        "--manifest {input.manifest:q} --captions {output.captions:q} --summary {output.summary:q} > {log:q} 2>&1"


rule latents:
    input:
        manifest=rules.prepare.output.manifest,
        captions=rules.caption.output.captions,
        model=model_files,
        raw=raw_files,
    output:
        index="results/latents/index.json",
        summary="results/latents/summary.json",
    log:
        "logs/latents.log",
    benchmark:
        "benchmarks/latents.tsv"
    conda:
        "../envs/sdpipe.yaml"
    resources:
        gpu=gpus_for("latents"),
    params:
        config=RESOLVED_CONFIG,
        settings=settings_of("latents"),
        model=use_model,
        raw=use_raw_dir,
    shell:
        "sdpipe latents --config {params.config:q} {params.model:q} {params.raw:q} --set latents.gpus={resources.gpu:q} "
        "--manifest {input.manifest:q} --captions {input.captions:q} "
        "--index {output.index:q} --summary {output.summary:q} > {log:q} 2>&1"
