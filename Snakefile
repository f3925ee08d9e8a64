# sdpipe: raw images -> prepare -> caption -> latents -> train -> export -> evaluate -> report and model card.
# Rules live in workflow/rules/, one file per phase; every rule calls one `sdpipe <stage>` command.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"


rule all:
    default_target: True
    input:
        rules.report.output,
        rules.card.output,
