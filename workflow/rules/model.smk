# The base model. With model.build_preset set (the embedded demo), a randomly initialised preset is built and
# saved in diffusers format at model.pretrained; a real checkpoint (hub id or local folder) needs no rule.

if BUILD_PRESET:

    rule base_model:
        output:
            directory(MODEL),
        conda:
            "../envs/sdpipe.yaml"
        log:
            "logs/base_model.log",
        params:
            preset=BUILD_PRESET,
            seed=CFG["seed"],
        shell:
            "sdpipe build-model --preset {params.preset} --seed {params.seed} --out {output} > {log} 2>&1"
