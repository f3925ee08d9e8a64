# The base model. With model.build_preset set (the embedded demo), a randomly initialised preset is built and
# saved in diffusers format at model.pretrained; a real checkpoint (hub id or local folder) needs no rule.
# With model.train_vae, its VAE is first trained on the training images (small domains trained from scratch).

if BUILD_PRESET:

    rule base_model:
        output:
            directory(MODEL),
        log:
            "logs/base_model.log",
        conda:
            "../envs/sdpipe.yaml"
        params:
            preset=BUILD_PRESET,
            seed=CFG["seed"],
        shell:
            "sdpipe build-model --preset {params.preset:q} --seed {params.seed:q} --out {output:q} > {log:q} 2>&1"


if TRAIN_VAE:

    rule train_vae:
        input:
            manifest="results/prepare/manifest.jsonl",
            model=base_model_files,
            raw=raw_files,
        output:
            model=directory("results/vae/model"),
            summary="results/vae/summary.json",
        log:
            "logs/train_vae.log",
        benchmark:
            "benchmarks/train_vae.tsv"
        conda:
            "../envs/sdpipe.yaml"
        resources:
            gpu=min(1, GPU_LIMIT),
        params:
            config=RESOLVED_CONFIG,
            model=use_model,
            raw=use_raw_dir,
            settings=settings_of("train_vae"),
        shell:
            "sdpipe train-vae --config {params.config:q} {params.model:q} {params.raw:q} --manifest {input.manifest:q} --out {output.model:q} "
            "--summary {output.summary:q} > {log:q} 2>&1"
