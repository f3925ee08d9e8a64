# The end of the DAG: export the trained weights (each format verified by reloading), evaluate the exported
# model, time training at several GPU counts (target `benchmark`, only with benchmark.gpu_counts), report, and
# write the model card (its own folder: results/export belongs to the export rule, and the card needs evaluate).


rule export:
    input:
        final=rules.train.output.final,
        model=model_files,
    output:
        **export_weight_files(),
        summary=report(f"{EXPORT_DIR}/{EXPORT_FILES.summary}", caption="../report/export.rst", category="Export"),
        diffusers=directory(f"{EXPORT_DIR}/{EXPORT_FILES.diffusers}"),
    log:
        "logs/export.log",
    benchmark:
        "benchmarks/export.tsv"
    conda:
        "../envs/sdpipe.yaml"
    resources:
        gpu=min(1, GPU_LIMIT),  # verification renders on the first GPU (export.verify.device: auto)
    params:
        config=RESOLVED_CONFIG,
        model=use_model,
        out=lambda wildcards, output: str(Path(output.summary).parent),
        settings=settings_of("export"),
    shell:
        "sdpipe export --config {params.config:q} {params.model:q} --final {input.final:q} --out {params.out:q} "
        "--summary {output.summary:q} > {log:q} 2>&1"


rule benchmark:
    input:
        index=rules.latents.output.index,
        model=model_files,
    output:
        scaling="results/benchmark/scaling.json",
    log:
        "logs/benchmark.log",
    conda:
        "../envs/sdpipe.yaml"
    resources:
        gpu=benchmark_gpus(),
    params:
        config=RESOLVED_CONFIG,
        model=use_model,
        settings=settings_of("benchmark"),
    shell:
        "sdpipe benchmark --config {params.config:q} {params.model:q} --index {input.index:q} "
        "--out results/benchmark --scaling {output.scaling:q} > {log:q} 2>&1"


rule evaluate:
    input:
        unpack(scaling_input),
        model=rules.export.output.diffusers,
        manifest=rules.prepare.output.manifest,
        train_summary=rules.train.output.summary,
        raw=raw_files,  # FID's real images
    output:
        metrics=report("results/evaluate/metrics.json", caption="../report/metrics.rst", category="Evaluation"),
        samples=directory("results/evaluate/samples"),
    log:
        "logs/evaluate.log",
    benchmark:
        "benchmarks/evaluate.tsv"
    conda:
        "../envs/sdpipe.yaml"
    resources:
        gpu=gpus_for("evaluate"),
    params:
        config=RESOLVED_CONFIG,
        settings=settings_of("evaluate"),
        raw=use_raw_dir,
    shell:
        "sdpipe evaluate --config {params.config:q} {params.raw:q} --set evaluate.gpus={resources.gpu:q} --model {input.model:q} "
        "--manifest {input.manifest:q} --train-summary {input.train_summary:q} --metrics {output.metrics:q} "
        "--samples {output.samples:q} > {log:q} 2>&1"


rule report:
    input:
        prepare=rules.prepare.output.summary,
        captions=rules.caption.output.summary,
        latents=rules.latents.output.summary,
        manifest=rules.prepare.output.manifest,
        train_summary=rules.train.output.summary,
        train_metrics=rules.train.output.metrics,
        export=rules.export.output.summary,
        metrics=rules.evaluate.output.metrics,
        samples=rules.evaluate.output.samples,
    output:
        html=report("results/report/index.html", caption="../report/report.rst", category="Report"),
        markdown="results/report/report.md",
        assets=directory("results/report/assets"),
    log:
        "logs/report.log",
    benchmark:
        "benchmarks/report.tsv"
    conda:
        "../envs/sdpipe.yaml"
    params:
        # Not an input: the run writes it when it starts (common.smk); the report reruns when the config changes.
        config=RESOLVED_CONFIG,
        settings=settings_of("report"),
    shell:
        "sdpipe report --config {params.config:q} --resolved-config {params.config:q} --prepare {input.prepare:q} --captions {input.captions:q} "
        "--latents {input.latents:q} --manifest {input.manifest:q} --train-summary {input.train_summary:q} "
        "--train-metrics {input.train_metrics:q} --samples-dir results/train/samples --export {input.export:q} "
        "--metrics {input.metrics:q} --eval-grid {input.samples:q}/grid.png --eval-prompts {input.samples:q}/prompts.json "
        "--html {output.html:q} --markdown {output.markdown:q} --assets {output.assets:q} > {log:q} 2>&1"


rule card:
    input:
        prepare=rules.prepare.output.summary,
        manifest=rules.prepare.output.manifest,
        captions=rules.caption.output.captions,
        train_summary=rules.train.output.summary,
        export=rules.export.output.summary,
        metrics=rules.evaluate.output.metrics,
        samples=rules.evaluate.output.samples,
    output:
        card=report("results/card/README.md", caption="../report/card.rst", category="Model card"),
        grid="results/card/samples.png",
    log:
        "logs/card.log",
    benchmark:
        "benchmarks/card.tsv"
    conda:
        "../envs/sdpipe.yaml"
    params:
        config=RESOLVED_CONFIG,
        settings=settings_of("card"),
    shell:
        # The user's config (model.pretrained is the base model the card names, not the trained-VAE folder).
        "sdpipe card --config {params.config:q} --prepare {input.prepare:q} --manifest {input.manifest:q} "
        "--captions {input.captions:q} --train-summary {input.train_summary:q} --export {input.export:q} "
        "--metrics {input.metrics:q} --eval-grid {input.samples:q}/grid.png --eval-prompts {input.samples:q}/prompts.json "
        "--card {output.card:q} --grid {output.grid:q} > {log:q} 2>&1"
